// The point where a test may kill a process in the middle of a save.
//
// Note [fault injection in saves]
// The atomic-file layer calls save_fault_point before every write, fsync and rename it makes. In
// the library it does nothing, and nothing else of the fault injection is in it, so an installed
// libfsdp carries no test hooks. tests/harness/save_fault_points.cpp defines the same function in
// libfsdp_save_fault_points.so, which tests/checkpoint/save_faults_test.cpp puts in front of the
// library with LD_PRELOAD in the ranks it starts: the dynamic linker then binds libfsdp's calls to
// it (a default-visibility function of another source file is called through the PLT, and the
// build uses neither -Bsymbolic nor LTO). That one numbers every operation in a process and, with
// FSDP_TEST_FAULT_KILL_AT=k (and FSDP_TEST_FAULT_KILL_RANK=r, matched against RANK), kills the
// process with SIGKILL just before the k-th: a machine losing power in the middle of a save, at a
// chosen byte boundary. FSDP_TEST_FAULT_LOG=path appends "<rank> <k> <operation> <file>" for each,
// so the test learns which numbers belong to a save and tries each.
#pragma once

namespace fsdp::detail {

/// Called before each write ("write"), fsync ("fsync", "fsync-directory") and rename ("rename") of
/// `file`. Does nothing here (Note [fault injection in saves]).
void save_fault_point(const char* operation, const char* file);

}  // namespace fsdp::detail

#include "io/fault_point.h"

namespace fsdp::detail {

// Empty on purpose, and in a source file of its own so that no call is inlined: the tests' preloaded
// library replaces it (Note [fault injection in saves]).
void save_fault_point(const char*, const char*) {}

}  // namespace fsdp::detail

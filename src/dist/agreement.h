// Private: collectives that keep ranks from waiting on each other forever, or aborting inside Gloo,
// when they disagree. They run on the control channel (Note [the control channel],
// src/dist/control_channel.h).
//
// Note [Agreement by digest]
// What every rank must agree on (a unit's parameter names, shapes and dtypes, the options, the
// checkpoint operation) first travels as a fixed-size digest: one all-reduce of 48 bytes
// (same_on_every_rank), whatever the model's size or the number of ranks. Only when the digests
// differ do the ranks gather each other's full text, to name each field that differs and every
// rank's value; that costs O(N x text) once, on a run that is about to fail anyway. Before, every
// fully_shard gathered every rank's full list: O(N x parameters) bytes on every rank before the
// first step. A failure report (raise_if_any_rank_failed) is the same: the longest error's length
// first, the errors only when one is not empty.
#pragma once

#include <fsdp/process_group.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Every rank states the operation it is entering; a rank that entered another one is named, and a
/// rank that never arrives makes the others fail after FSDP_COLLECTIVE_TIMEOUT with a message that
/// says every rank must call `operation` (calling it on rank 0 only is the classic mistake).
void agree_on_operation(const DistributedContext& context, const std::string& operation);

/// Raises on every rank when any rank's `local_error` is non-empty (naming that rank), so one rank's
/// missing file cannot leave the others blocked in the next collective.
void raise_if_any_rank_failed(const DistributedContext& context, const std::string& local_error);

/// Runs `step` (local work such as file I/O) on this rank, then raises on every rank if it failed on
/// any of them. Collective.
void run_on_every_rank(const DistributedContext& context, const std::function<void()>& step);

/// Every rank states the values that must be the same on all ranks (a name and its value's text,
/// the same names in the same order). When they differ, every rank raises the same error: `what`,
/// each field that differs with the ranks holding each value ("'sharding_strategy' is FULL_SHARD on
/// ranks 0, 2 and NO_SHARD on rank 1"), then `fix`. Collective (the control channel); no data
/// collective is reached with ranks that disagree, so they get this error instead of a Gloo abort
/// or a wait for the timeout.
void agree_on_fields(const DistributedContext& context, const std::string& what,
                     const std::vector<std::pair<std::string, std::string>>& fields, const std::string& fix);

/// An exception's message without a C++ backtrace.
std::string message_of(const std::exception& error);

}  // namespace fsdp::detail

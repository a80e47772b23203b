// Private: collectives that keep ranks from waiting on each other forever, or aborting inside Gloo,
// when they disagree. They run on the control channel (Note [the control channel],
// src/dist/control_channel.h).
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <fsdp/process_group.h>

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

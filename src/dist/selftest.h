// Private: `fsdp selftest`, a check of every collective across the ranks of a real job.
#pragma once

#include <fsdp/process_group.h>

#include <string>
#include <vector>

namespace fsdp::detail {

struct SelftestReport {
  /// True when every check passed on every rank (the verdict is agreed over the world group).
  bool passed = true;
  /// This rank's failed checks, one line each.
  std::vector<std::string> failures;
  /// Human-readable lines: the byte counts against theory and a summary. Same on every rank.
  std::vector<std::string> lines;
};

/// Runs all-gather, reduce-scatter, all-reduce, broadcast and barrier for every dtype, for sizes
/// not divisible by the group size and for empty shards, on the world and on both node groups,
/// synchronously and asynchronously, and checks the byte counters against (N-1)/N.
SelftestReport run_collective_selftest(const DistributedContext& context);

}  // namespace fsdp::detail

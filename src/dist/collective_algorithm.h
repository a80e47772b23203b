// Private: which algorithm a CPU collective runs, chosen per (group size, bytes) by measurement.
//
// Note [Algorithms by measurement]
// `collective_bench --sweep` times each collective at 64 KB to 64 MB and N = 2, 4, 8, 16 on one
// machine, with the collective check off (it costs every algorithm the same per collective), ours
// (the direct exchange: every rank sends each peer its part at once, Note [Collectives on Gloo])
// against Gloo's own algorithm (a ring), and bench/README.md ("Collective algorithms", from
// bench/scale.sh) records the table. What it showed, and what the engine therefore does:
// - all-gather and reduce-scatter: the direct exchange took 0.19-0.79x Gloo's time at every size
//   at N = 2, 8 and 16, and 0.23-1.30x at N = 4 (at or above 1.0 only from 64 KB to 4 MB, where
//   both take under 8 ms and 4 ranks share 2 cores): direct everywhere, as before.
// - all-reduce: Gloo's ring against the direct reduce-scatter then all-gather of the same buffer
//   (the same 2(N-1)/N bytes). At N = 2 and 4 the ring is faster or equal (direct 0.98-2.3x); at
//   N = 8 and 16 its 2(N-1) steps in sequence cost it: direct took 0.43-0.67x its time up to 4 MB
//   and 0.85-1.03x at 16 and 64 MB. So: Gloo's ring below 8 ranks, direct from 8.
// Both move 2(N-1)/N of the buffer (the direct one pads it to a multiple of N, so for a buffer that
// does not divide it counts 2(N-1) x ceil(numel/N) elements: Note [Byte counters]). The
// direct all-reduce's second half needs the first's result, so it runs on the group's issue queue
// (Note [Collective check]) and `all_reduce_async` still returns at once. On a network the ring's
// advantage is fewer simultaneous flows per link, which one machine's loopback cannot show: a
// two-host measurement (not made yet) may move the thresholds, which are this one function. The
// direct exchange's N-1 messages per rank per collective are the cost at 1000 ranks, where a ring or
// a tree in its place is the next step.
#pragma once

#include <cstdint>

namespace fsdp::detail {

enum class AllReduceAlgorithm { kGlooRing, kDirect };

/// Note [Algorithms by measurement]: the all-reduce algorithm for a CPU group of `group_size` ranks
/// reducing `bytes`. Pure.
AllReduceAlgorithm choose_all_reduce(int64_t group_size, int64_t bytes);

}  // namespace fsdp::detail

// Private: which algorithm a CPU collective runs, read from a table of measurements. Pure, but for
// engine_algorithm_table(), which reads FSDP_COLLECTIVE_TABLE's file once.
//
// Note [Algorithms by measurement]
// A group's members sit on machines: `machines` machines of `ranks_per_machine` ranks each (the
// node layout every rank reported at the rendezvous, Note [Process groups]). The CPU collectives
// have four algorithms, all point-to-point messages on the collective's keyed slot (Note
// [Collective check]) between the caller's buffers and pooled staging blocks:
// - direct: every rank exchanges with every peer at once. N-1 messages per rank; each rank sends
//   (N-1)/N of the buffer, L(N-L)/N of it to other machines. The fewest steps (one), the most
//   messages and, across machines, the most bytes off each machine.
// - ring: N-1 steps around the group's ranks in order (a reduction's partial sums travel on). One
//   message per step; 2 of the ring's N edges leave a machine of a node-major group, so each
//   machine sends (N-1)/N of the buffer off it, but the N-1 steps are in sequence.
// - two_level_direct, two_level_ring: inside each machine, then between the ranks of the same local
//   index across machines (direct, or a ring of the M machines); all-gather crosses first and then
//   spreads inside the machine, reduce-scatter reduces inside first, all-reduce is the two in a row.
//   (M-1) + (L-1) messages per rank; each machine sends the minimum off it, (M-1)/M of the buffer
//   for all-gather and reduce-scatter and 2(M-1)/M for all-reduce. Needs M > 1 and L > 1 and a
//   group whose rank g is on its g / L-th machine (node-major, as the launchers number ranks).
//   two_level_direct cuts a rank's chunk into P pieces (two_level_pieces: 4 or 2 of at least 256 KB,
//   else 1), and each piece goes on to the next level as soon as it is ready, so the network carries
//   one piece while the machine's own links carry the one before: P((M-1) + (L-1)) messages. Without
//   it the two levels ran one after the other, and on 2 x 4 shaped machines a 64 MB all-gather took
//   535 ms against the ring's 525 (pieces: 350 ms).
// `collective_bench --sweep` runs every algorithm that applies to the group it is started on, the
// engine's own calls, at 64 KB to 64 MB, two collectives in flight at once as the engine's prefetch
// keeps them (timed alone, a two-level collective's levels wait for each other, and the sweep chose
// the ring for FULL_SHARD's 8 MB units on 4 shaped machines of 2, whose steps then took 2.24 s against
// 1.65 s with two levels), in rounds that alternate the algorithms, and writes the
// choice per (operation, layout, bytes) as this table's rows: the layout's default (direct;
// two_level_direct across machines) unless another algorithm's median is at least 10 % faster, a
// size whose choice differs from both neighbours' taking theirs (on a shared 2-core machine the rounds
// vary more than close algorithms differ). bench/collective_table.sh runs it on one machine at N = 2
// to 16 and on 2 and 4 shaped machines, and writes src/dist/collective_algorithms.tsv, which the
// library embeds. A
// collective takes the rows of its operation whose layout is of its kind (one machine; one rank per
// machine; several of each) and nearest to its own (by log2 of machines, then of ranks per
// machine), and among those the first row whose `up to bytes` holds its buffer. A user measures
// their own cluster with the same command and points FSDP_COLLECTIVE_TABLE at the file;
// FSDP_DEBUG=1 prints each choice once per group, operation and row.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

enum class CollectiveOperation {
  /// fsdp::all_gather: every rank's shard to every rank.
  kAllGather,
  /// fsdp::reduce_scatter: the reduction of shard r to rank r.
  kReduceScatter,
  /// fsdp::all_reduce (and barrier): the reduction to every rank.
  kAllReduce,
};

enum class CollectiveAlgorithm {
  /// Every rank exchanges with every peer at once.
  kDirect,
  /// N-1 steps around the ring of the group's ranks.
  kRing,
  /// Inside each machine, then a direct exchange between the ranks of one local index.
  kTwoLevelDirect,
  /// Inside each machine, then a ring of the machines between the ranks of one local index.
  kTwoLevelRing,
};

const char* to_string(CollectiveOperation operation);
const char* to_string(CollectiveAlgorithm algorithm);

/// How a group's members sit on machines. `regular`: every machine holds `ranks_per_machine` of
/// them and group rank g is on the (g / ranks_per_machine)-th machine in the order they first appear.
struct GroupShape {
  int64_t machines = 1;
  int64_t ranks_per_machine = 1;
  bool regular = true;
  int64_t size() const { return machines * ranks_per_machine; }
  bool two_level() const { return regular && machines > 1 && ranks_per_machine > 1; }
};

/// The shape of a group whose member i is on machine `member_machines[i]` (any machine labels).
GroupShape group_shape(const std::vector<int64_t>& member_machines);

/// Whether `algorithm` can run on a group of `shape`.
bool algorithm_applies(CollectiveAlgorithm algorithm, const GroupShape& shape);

struct AlgorithmTableRow {
  CollectiveOperation operation = CollectiveOperation::kAllGather;
  int64_t machines = 1;
  int64_t ranks_per_machine = 1;
  /// The largest buffer (bytes: all-gather's output, reduce-scatter's input, all-reduce's tensor) the
  /// row is for; -1 for any size above the layout's other rows.
  int64_t max_bytes = -1;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kDirect;
  /// Line of the table's text it came from (for FSDP_DEBUG and errors).
  int64_t line = 0;
};

struct AlgorithmTable {
  /// Where it came from: "the built-in table" or the file's path.
  std::string source;
  std::vector<AlgorithmTableRow> rows;
};

/// Parses a table (tab- or space-separated: operation, machines, ranks_per_machine, max_bytes or
/// "-", algorithm; a header line naming those columns; '#' comments). The text is untrusted: an
/// error names `source`, the line, the field, what was expected and what was found.
AlgorithmTable parse_algorithm_table(const std::string& text, const std::string& source);

/// The table's text, as parse_algorithm_table reads it (the sweep writes it).
std::string format_algorithm_table(const std::vector<AlgorithmTableRow>& rows, const std::string& comment);

struct AlgorithmChoice {
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kDirect;
  /// The row that decided, or null when no row's layout is of the group's kind (then direct, or
  /// two_level_direct where the group has two levels).
  const AlgorithmTableRow* row = nullptr;
};

/// Note [Algorithms by measurement]: the algorithm for `operation` on a group of `shape` moving
/// `bytes`. Pure.
AlgorithmChoice choose_algorithm(const AlgorithmTable& table, CollectiveOperation operation, const GroupShape& shape,
                                 int64_t bytes);

/// Note [Algorithms by measurement]: into how many pieces two_level_direct cuts each rank's chunk of
/// `chunk_elements` elements of `element_bytes`, so that the second level of one piece overlaps the
/// first level of the next: 4 or 2 pieces that divide the chunk and are at least 256 KB each, else 1.
int64_t two_level_pieces(int64_t chunk_elements, int64_t element_bytes);

/// What one rank sends for one collective under `algorithm` on a group of `shape` (regular), for a
/// buffer of `buffer_bytes` (all-gather's output, reduce-scatter's input, all-reduce's tensor; a
/// multiple of the group size) of elements of `element_bytes` (an all-gather moves bytes: 1): the
/// theory the byte counters are checked against (Note [Byte counters]).
struct TrafficPerRank {
  int64_t messages = 0;
  int64_t bytes = 0;
  int64_t off_machine_bytes = 0;
};
TrafficPerRank traffic_per_rank(CollectiveOperation operation, CollectiveAlgorithm algorithm, const GroupShape& shape,
                                int64_t group_rank, int64_t buffer_bytes, int64_t element_bytes);

/// The text of the built-in table (src/dist/collective_algorithms.tsv, embedded at build time).
const std::string& builtin_algorithm_table_text();

/// The table the collectives use: FSDP_COLLECTIVE_TABLE's file when set (read once, a named error
/// when it cannot be read or parsed), else the built-in one.
const AlgorithmTable& engine_algorithm_table();

}  // namespace fsdp::detail

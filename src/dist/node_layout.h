// Private: which ranks share a machine, planned from what every rank reported at the rendezvous.
#pragma once

#include <cstdint>
#include <vector>

namespace fsdp::detail {

/// Which global ranks form each intra-node and cross-node group, from the layout every rank
/// reported. Pure; throws when the reports disagree (different LOCAL_WORLD_SIZE, or a rank whose
/// node_rank * local_world_size + local_rank is not its rank).
struct NodeLayout {
  int64_t local_world_size = 1;
  int64_t num_nodes = 1;
  /// intra_node_groups[node] = global ranks on that node.
  std::vector<std::vector<int64_t>> intra_node_groups;
  /// cross_node_groups[local_rank] = global ranks with that local rank.
  std::vector<std::vector<int64_t>> cross_node_groups;
};
struct RankReport {
  int64_t rank = 0;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  int64_t node_rank = 0;
};
NodeLayout plan_node_layout(const std::vector<RankReport>& reports);

}  // namespace fsdp::detail

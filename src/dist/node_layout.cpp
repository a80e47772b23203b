#include "dist/node_layout.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

NodeLayout plan_node_layout(const std::vector<RankReport>& reports) {
  TORCH_CHECK(!reports.empty(), "plan_node_layout: no rank reported its layout.");
  NodeLayout layout;
  layout.local_world_size = reports.front().local_world_size;
  const int64_t world_size = static_cast<int64_t>(reports.size());
  for (size_t index = 0; index < reports.size(); ++index) {
    const auto& report = reports[index];
    TORCH_CHECK(report.rank == static_cast<int64_t>(index), "rendezvous: the report at position ", index,
                " came from rank ", report.rank, "; ranks must be 0..", world_size - 1, " with no duplicates.");
    TORCH_CHECK(report.local_world_size == layout.local_world_size,
                "rendezvous: ranks disagree on LOCAL_WORLD_SIZE: rank 0 has ", layout.local_world_size, " but rank ",
                report.rank, " has ", report.local_world_size, ". Start every machine with the same --nproc-per-node.");
    const int64_t expected_rank = report.node_rank * report.local_world_size + report.local_rank;
    TORCH_CHECK(expected_rank == report.rank, "rendezvous: rank ", report.rank, " reports node ", report.node_rank,
                " and local rank ", report.local_rank, " (local world size ", report.local_world_size,
                "), which is rank ", expected_rank,
                " under the block layout every launcher uses. Give each machine a distinct --node-rank and the same "
                "--nproc-per-node.");
  }
  TORCH_CHECK(world_size % layout.local_world_size == 0, "rendezvous: world size ", world_size,
              " is not a multiple of LOCAL_WORLD_SIZE=", layout.local_world_size, ".");
  layout.num_nodes = world_size / layout.local_world_size;
  layout.intra_node_groups.resize(layout.num_nodes);
  layout.cross_node_groups.resize(layout.local_world_size);
  for (const auto& report : reports) {
    layout.intra_node_groups[report.node_rank].push_back(report.rank);
    layout.cross_node_groups[report.local_rank].push_back(report.rank);
  }
  return layout;
}

}  // namespace fsdp::detail

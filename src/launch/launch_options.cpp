#include "launch/launch_options.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

void validate(const LaunchOptions& options) {
  TORCH_CHECK(options.nproc_per_node >= 1, "fsdp launch: --nproc-per-node ", options.nproc_per_node,
              " must be at least 1.");
  TORCH_CHECK(options.nnodes >= 1, "fsdp launch: --nnodes ", options.nnodes, " must be at least 1.");
  TORCH_CHECK(options.node_rank >= 0 && options.node_rank < options.nnodes, "fsdp launch: --node-rank ",
              options.node_rank, " must be in [0, --nnodes ", options.nnodes, ").");
  TORCH_CHECK(options.max_restarts >= 0, "fsdp launch: --max-restarts ", options.max_restarts,
              " must be 0 or more (torchrun's meaning: how many times to start the job again after a failure).");
  const int64_t min_nnodes = min_nodes(options);
  TORCH_CHECK(min_nnodes >= 1 && min_nnodes <= options.nnodes, "fsdp launch: --nnodes ", min_nnodes, ":",
              options.nnodes, " is not MIN:MAX with 1 <= MIN <= MAX; e.g. --nnodes 1:4 runs on 1 to 4 machines.");
  TORCH_CHECK(options.join_timeout.count() > 0 && options.last_call_timeout.count() >= 0,
              "fsdp launch: --rdzv-conf join_timeout must be above 0 and last_call_timeout 0 or more (seconds).");
  TORCH_CHECK(options.master_port >= 0 && options.master_port <= 65535, "fsdp launch: --master-port ",
              options.master_port, " is not a TCP port; expected [1, 65535], or 0 for a free one.");
  if (options.nnodes > 1) {
    TORCH_CHECK(options.master_port != 0,
                "fsdp launch: --master-port 0 picks a port on this machine only, but the "
                "job spans ",
                options.nnodes,
                " machines that must agree on it; give the same explicit --master-port on every machine.");
    const bool loopback = options.master_addr.rfind("127.", 0) == 0 || options.master_addr == "localhost";
    TORCH_CHECK(!loopback, "fsdp launch: --master-addr ", options.master_addr,
                " is a loopback address but the job "
                "spans ",
                options.nnodes, " machines; pass the address of the machine with --node-rank 0.");
  }
  TORCH_CHECK(!options.command.empty(),
              "fsdp launch: no program given; put the command after `--`, e.g. "
              "`fsdp launch --nproc-per-node 2 -- ./train --steps 10`.");
}

int64_t min_nodes(const LaunchOptions& options) {
  return options.min_nnodes == 0 ? options.nnodes : options.min_nnodes;
}

bool is_elastic(const LaunchOptions& options) {
  return options.nnodes > 1 && (options.max_restarts > 0 || min_nodes(options) < options.nnodes);
}

}  // namespace fsdp::detail

#include <c10/util/Exception.h>
#include <fsdp/memory_estimate.h>
#include <fsdp/shard_layout.h>

#include <algorithm>
#include <unordered_set>

#include "dist/collective_algorithm.h"

namespace fsdp {

const char* to_string(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kSgdMomentum:
      return "sgd-momentum";
    case OptimizerKind::kSgd:
      return "sgd";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown OptimizerKind");
}

OptimizerKind parse_optimizer_kind(const std::string& text, const std::string& what) {
  if (text == "adamw" || text == "adam") return OptimizerKind::kAdamW;
  if (text == "sgd-momentum") return OptimizerKind::kSgdMomentum;
  if (text == "sgd") return OptimizerKind::kSgd;
  TORCH_CHECK(false, what, ": unknown optimizer '", text, "'; choose adamw (or adam), sgd-momentum or sgd");
}

int64_t optimizer_states_per_parameter(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return 2;
    case OptimizerKind::kSgdMomentum:
      return 1;
    case OptimizerKind::kSgd:
      return 0;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown OptimizerKind");
}

std::vector<UnitShape> unit_shapes(const torch::nn::Module& model, const std::vector<UnitModules>& units) {
  std::unordered_set<const void*> owned;
  std::unordered_map<const torch::nn::Module*, std::string> names;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) names[item.value().get()] = item.key();
  std::vector<UnitShape> shapes;
  auto take = [&](const torch::nn::Module& module, UnitShape& shape) {
    for (const auto& parameter : module.parameters()) {
      if (!owned.insert(parameter.unsafeGetTensorImpl()).second) continue;
      shape.parameter_sizes.push_back(parameter.sizes().vec());
    }
  };
  for (const auto& unit : units) {
    UnitShape shape;
    shape.reshard_after_forward = unit.reshard_after_forward;
    for (const auto& module : unit.modules) {
      TORCH_CHECK(module && names.count(module.get()), "unit_shapes: a unit's module is not a submodule of the model");
      shape.name += (shape.name.empty() ? "" : "+") + names.at(module.get());
      take(*module, shape);
    }
    shapes.push_back(std::move(shape));
  }
  UnitShape root;
  root.reshard_after_forward = false;
  take(model, root);
  shapes.push_back(std::move(root));
  return shapes;
}

void MemoryEstimateOptions::validate() const {
  TORCH_CHECK(world_size >= 1, "estimate-memory: the number of ranks must be at least 1, got ", world_size);
  const int64_t machine = ranks_per_machine == 0 ? world_size : ranks_per_machine;
  TORCH_CHECK(machine >= 1 && world_size % machine == 0, "estimate-memory: ranks per machine must divide the ",
              world_size, " ranks, got ", ranks_per_machine);
  TORCH_CHECK(
      sharding_strategy != ShardingStrategy::kNoShard || !reshard_after_forward ||
          !reshard_after_forward->is_group_size(),
      "estimate-memory: reshard_after_forward=", reshard_after_forward ? reshard_after_forward->to_string() : "",
      " is a group to shard over after forward, and NO_SHARD shards nothing; give it without NO_SHARD");
  auto floating = [](c10::ScalarType dtype) { return c10::isFloatingType(dtype); };
  TORCH_CHECK(floating(storage_dtype), "estimate-memory: the storage dtype must be floating, got ", storage_dtype);
  TORCH_CHECK(!mixed_precision.param_dtype || floating(*mixed_precision.param_dtype),
              "estimate-memory: param_dtype must be floating, got ", *mixed_precision.param_dtype);
  TORCH_CHECK(!mixed_precision.reduce_dtype || floating(*mixed_precision.reduce_dtype),
              "estimate-memory: reduce_dtype must be floating, got ", *mixed_precision.reduce_dtype);
}

int64_t MemoryEstimate::training_step_bytes(bool prefetch, int64_t activation_bytes) const {
  const int64_t forward =
      (prefetch ? unsharded_peak_bytes_with_prefetch : unsharded_peak_bytes_without_prefetch) + activation_bytes;
  return model_state_bytes() + std::max(forward, reduction_bytes);
}

namespace {

// An all-reduce pads its buffer to a multiple of the group (Note [Byte counters]).
int64_t padded_all_reduce(int64_t elements, int64_t group) { return (elements + group - 1) / group * group; }

}  // namespace

MemoryEstimate estimate_memory(const std::vector<UnitShape>& units, const MemoryEstimateOptions& options) {
  options.validate();
  TORCH_CHECK(!units.empty(), "estimate-memory: the model has no units (unit_shapes gives at least the root)");
  const ShardingStrategy strategy = options.sharding_strategy;
  const bool hybrid = strategy == ShardingStrategy::kHybridShard || strategy == ShardingStrategy::kHybridShardZero2;
  const bool no_shard = strategy == ShardingStrategy::kNoShard;
  const int64_t world = options.world_size;
  const int64_t machine = options.ranks_per_machine == 0 ? world : options.ranks_per_machine;
  MemoryEstimate estimate;
  estimate.units = static_cast<int64_t>(units.size());
  estimate.shard_group_size = no_shard ? 1 : hybrid ? machine : world;
  estimate.replicate_group_size = world / estimate.shard_group_size;
  const int64_t shards = estimate.shard_group_size, replicas = estimate.replicate_group_size;
  const ReshardAfterForward reshard =
      options.reshard_after_forward.value_or(ReshardAfterForward(reshards_after_forward(strategy)));
  // 1: keeps everything after forward; shards: reshards fully; between: hpZ's rows of k ranks.
  const int64_t post_forward_group =
      no_shard ? 1 : reshard.post_forward_group_size(shards, "every unit that reshards after forward");
  const int64_t storage = static_cast<int64_t>(c10::elementSize(options.storage_dtype));
  const int64_t compute =
      static_cast<int64_t>(c10::elementSize(options.mixed_precision.param_dtype.value_or(options.storage_dtype)));
  const int64_t reduce = static_cast<int64_t>(c10::elementSize(options.mixed_precision.reduce_dtype.value_or(
      options.mixed_precision.param_dtype.value_or(options.storage_dtype))));
  const int64_t states = optimizer_states_per_parameter(options.optimizer);
  // What a rank sends off its machine for one collective over a group of `size` consecutive ranks
  // (machines of `machine` ranks) moving `buffer` bytes: the algorithm the engine takes for it from
  // its table (Note [Algorithms by measurement]), averaged over the group's ranks (a ring's differ).
  const auto off_machine = [&](detail::CollectiveOperation operation, int64_t size, double buffer,
                               int64_t element_bytes) {
    if (size <= 1) return 0.0;
    const int64_t per_machine = std::min(machine, size);
    const detail::GroupShape shape{size / per_machine, per_machine, size % per_machine == 0};
    const auto algorithm =
        detail::choose_algorithm(detail::engine_algorithm_table(), operation, shape, static_cast<int64_t>(buffer))
            .algorithm;
    double total = 0;
    for (int64_t rank = 0; rank < size; ++rank) {
      total += static_cast<double>(
          detail::traffic_per_rank(operation, algorithm, shape, rank, static_cast<int64_t>(buffer), element_bytes)
              .off_machine_bytes);
    }
    return total / static_cast<double>(size);
  };

  std::vector<int64_t> resharding_units;    // unsharded bytes (compute dtype, padded) of the units that reshard
  std::vector<int64_t> padded_elements_of;  // every unit's padded elements (over the shard group), in order
  int64_t kept_bytes = 0;                   // ... of the units that stay unsharded after forward
  double sent = 0, sent_off_machine = 0;
  int64_t owned_elements_rank0 = 0, largest_shard_elements = 0;
  for (size_t index = 0; index < units.size(); ++index) {
    const bool kept = !units[index].reshard_after_forward;
    int64_t shard_elements = 0, padded_elements = 0, unit_elements = 0;
    for (const auto& sizes : units[index].parameter_sizes) {
      const auto layout = shard_layout(sizes, shards, /*rank=*/0);
      shard_elements += layout.numel_padded_shard;
      padded_elements += layout.numel_padded_shard * shards;
      unit_elements += layout.numel_unsharded();
      owned_elements_rank0 += layout.numel_owned;
      largest_shard_elements = std::max(largest_shard_elements, layout.numel_padded_shard);
    }
    estimate.parameters += unit_elements;
    estimate.parameter_bytes += shard_elements * storage;
    if (kept)
      kept_bytes += padded_elements * compute;
    else
      resharding_units.push_back(padded_elements * compute);
    padded_elements_of.push_back(padded_elements);
    estimate.largest_unit_bytes = std::max(estimate.largest_unit_bytes, padded_elements * compute);
    if (no_shard) {
      // All-reduce of the gradients over the world: 2 (N - 1) / N of them.
      const double bytes = 2.0 * static_cast<double>(world - 1) / static_cast<double>(world) *
                           static_cast<double>(unit_elements * reduce);
      sent += bytes;
      sent_off_machine += off_machine(detail::CollectiveOperation::kAllReduce, world,
                                      static_cast<double>(padded_all_reduce(unit_elements, world) * reduce), reduce);
      continue;
    }
    const double shard_compute = static_cast<double>(shard_elements * compute);
    const double peers = static_cast<double>(shards - 1);
    // Forward's all-gather and the reduce-scatter, over the shard group (inside a machine under
    // HYBRID_SHARD, whose group is the machine).
    sent += peers * shard_compute + peers * static_cast<double>(shard_elements * reduce);
    if (!hybrid) {
      sent_off_machine += off_machine(detail::CollectiveOperation::kAllGather, shards, shard_compute * shards, 1) +
                          off_machine(detail::CollectiveOperation::kReduceScatter, shards,
                                      static_cast<double>(shard_elements * reduce * shards), reduce);
    }
    // Backward's all-gather: every unit that resharded after forward; over k consecutive ranks,
    // each sending its row of shards / k shards to k - 1 of them.
    if (!kept && post_forward_group > 1) {
      const double k = static_cast<double>(post_forward_group);
      const double row = shard_compute * static_cast<double>(shards) / k;
      sent += (k - 1) * row;
      if (!hybrid) {
        sent_off_machine += off_machine(detail::CollectiveOperation::kAllGather, post_forward_group, row * k, 1);
      }
    }
    // HYBRID_SHARD: the reduced shard is all-reduced across the replicas (one rank per machine).
    if (replicas > 1) {
      const double bytes = 2.0 * static_cast<double>(replicas - 1) / static_cast<double>(replicas) *
                           static_cast<double>(shard_elements * reduce);
      sent += bytes;
      sent_off_machine += bytes;
    }
  }
  estimate.gradient_bytes = estimate.parameter_bytes;
  estimate.optimizer_bytes = states * estimate.parameter_bytes;
  estimate.bytes_sent_per_step = static_cast<int64_t>(sent);
  estimate.bytes_sent_off_machine_per_step = static_cast<int64_t>(sent_off_machine);

  estimate.kept_unit_bytes = kept_bytes;
  std::sort(resharding_units.rbegin(), resharding_units.rend());
  const int64_t largest = resharding_units.empty() ? 0 : resharding_units[0];
  const int64_t second = resharding_units.size() > 1 ? resharding_units[1] : 0;
  if (no_shard) {
    // Nothing is gathered: the parameters are the unsharded ones.
    estimate.unsharded_peak_bytes_without_prefetch = estimate.unsharded_peak_bytes_with_prefetch = 0;
  } else if (post_forward_group == 1) {
    // Nothing reshards after forward: at the end of forward every unit is unsharded.
    int64_t all = kept_bytes;
    for (const int64_t bytes : resharding_units) all += bytes;
    estimate.unsharded_peak_bytes_without_prefetch = estimate.unsharded_peak_bytes_with_prefetch = all;
  } else {
    // The kept units stay unsharded from their forward to their backward; the others come and go,
    // one (or two, prefetched) at a time; hpZ's units keep their 1/k rows meanwhile.
    int64_t rows = 0;
    if (post_forward_group < shards) {
      for (const int64_t bytes : resharding_units) rows += bytes / post_forward_group;
    }
    estimate.unsharded_peak_bytes_without_prefetch = kept_bytes + largest + rows;
    estimate.unsharded_peak_bytes_with_prefetch = kept_bytes + largest + second + rows;
  }
  // A unit's three unit-sized blocks around its reduction (Note [estimating memory per rank]): one in
  // the compute dtype (its unsharded gradients, or its unsharded parameters), the reduce-scatter's
  // input and its received rows in the reduce dtype.
  const auto reduction_blocks = [&](int64_t elements) { return elements * (compute + 2 * reduce); };
  // The largest unit's reduction: its gradients and the reduce-scatter's blocks, beside the kept
  // units' unsharded parameters and its own. NO_SHARD's all-reduce works on the gradients themselves;
  // its received rows are the optimizer step's pooled blocks below.
  auto largest_first = padded_elements_of;  // units.size() >= 1 (checked above)
  std::sort(largest_first.rbegin(), largest_first.rend());
  if (!no_shard) {
    estimate.unsharded_gradient_bytes = reduction_blocks(largest_first[0]);
    // Held meanwhile: the kept units and one resharding unit (hpZ's rows; everything when nothing
    // reshards), as without prefetch, but no resharding unit while a kept one is the largest.
    const bool largest_is_kept = largest < estimate.largest_unit_bytes;
    int64_t held = estimate.unsharded_peak_bytes_without_prefetch;
    if (post_forward_group != 1 && largest_is_kept) held -= largest;
    // The pool still holds the blocks of the unit reduced just before (its unsharded parameters,
    // reduce-scatter input and received rows); the largest other unit's, as that one is not known here.
    estimate.pooled_bytes_in_reduction = largest_first.size() > 1 ? reduction_blocks(largest_first[1]) : 0;
    estimate.reduction_bytes = held + estimate.unsharded_gradient_bytes + estimate.pooled_bytes_in_reduction;
  }
  // The optimizer step: AdamW's two temporaries (sqrt, then the quotient) or SGD's one, the size of
  // the largest parameter's shard; the pool's blocks from the last unit reduced, the root (or, when
  // the root owns nothing, the first unit, whose backward runs last).
  estimate.optimizer_step_temporary_bytes =
      (options.optimizer == OptimizerKind::kAdamW ? 2 : 1) * largest_shard_elements * storage;
  // Its unsharded parameters and the reduce-scatter's blocks; NO_SHARD's all-reduce keeps only the
  // received rows (the direct algorithms of one machine, src/dist/c10d/schedules.cpp).
  const int64_t last_elements =
      units.back().parameter_sizes.empty() ? padded_elements_of.front() : padded_elements_of.back();
  if (!no_shard) {
    estimate.pooled_bytes_in_optimizer_step = reduction_blocks(last_elements);
  } else if (world > 1) {
    estimate.pooled_bytes_in_optimizer_step = padded_all_reduce(last_elements, world) * reduce;
  }
  estimate.runtime_bytes = kRuntimeBytes;

  // Checkpoints: the owned rows (no padding) of the parameters and of each optimizer state.
  estimate.sharded_checkpoint_bytes = owned_elements_rank0 * storage * (1 + states);
  estimate.full_checkpoint_bytes = estimate.parameters * storage * (1 + states);
  return estimate;
}

}  // namespace fsdp

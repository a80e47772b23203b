#include "checkpoint/fsdp1_local_files.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include <fsdp/torch_file.h>

namespace fsdp::detail {

namespace {

// FSDP1's name for a unit's flat parameter in its state dicts (FLAT_PARAM in torch 2.x).
constexpr const char* kFlatParam = "_flat_param";

// One unit's flat parameter, put together from every rank's chunk.
struct FlatParameter {
  at::Tensor whole;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [begin, end) of each chunk read, to check coverage
  std::string first_file;
};

std::string unit_name(const std::string& prefix) { return prefix.empty() ? "the root unit" : "unit '" + prefix + "'"; }

// Where each parameter starts in the flat parameter, and its total, for an alignment of `aligned`
// elements (0: none) on `world_size` ranks (Note [FSDP1 flat parameters]).
std::pair<std::vector<int64_t>, int64_t> layout(const std::vector<int64_t>& numels, int64_t aligned, int64_t world_size) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto numel : numels) {
    if (aligned > 0 && total % aligned != 0) total += aligned - total % aligned;
    offsets.push_back(total);
    total += numel;
  }
  if (aligned > 0 && total % world_size != 0) total += world_size - total % world_size;
  return {offsets, total};
}

}  // namespace

TensorList full_state_dict_from_fsdp1_local_files(const std::vector<std::string>& files,
                                                  const std::vector<ParameterShape>& parameters) {
  TORCH_CHECK(!files.empty(), "LOCAL_STATE_DICT: no model files to read");
  const auto world_size = static_cast<int64_t>(files.size());
  std::map<std::string, FlatParameter> flats;  // by unit path ("" for the root)
  TensorList plain;                            // rank 0's plain tensors
  for (size_t rank = 0; rank < files.size(); ++rank) {
    const auto& file = files[rank];
    auto state = load_state_dict_with_sharded_tensors(file);
    if (rank == 0) plain = std::move(state.tensors);
    for (auto& [name, sharded] : state.sharded) {
      const std::string suffix = kFlatParam;
      TORCH_CHECK(name == suffix || (name.size() > suffix.size() + 1 && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                                     name[name.size() - suffix.size() - 1] == '.'),
                  "'", file, "' holds a ShardedTensor '", name, "' that is not an FSDP1 flat parameter (<unit>.",
                  kFlatParam, "): not a LOCAL_STATE_DICT model file of FSDP1");
      const auto prefix = name == suffix ? std::string() : name.substr(0, name.size() - suffix.size() - 1);
      TORCH_CHECK(sharded.size.size() == 1, "'", file, "': the flat parameter of ", unit_name(prefix), " has ",
                  sharded.size.size(), " dimensions, expected 1");
      auto [found, inserted] = flats.try_emplace(prefix);
      auto& flat = found->second;
      if (inserted) {
        const auto dtype = sharded.local_shards.empty() ? at::kFloat : sharded.local_shards.front().tensor.scalar_type();
        flat.whole = at::zeros({sharded.size[0]}, at::TensorOptions().dtype(dtype));
        flat.first_file = file;
      }
      TORCH_CHECK(flat.whole.size(0) == sharded.size[0], "'", file, "' gives the flat parameter of ", unit_name(prefix),
                  " ", sharded.size[0], " elements where '", flat.first_file, "' gives ", flat.whole.size(0),
                  ": the files are not from one save");
      for (const auto& shard : sharded.local_shards) {
        TORCH_CHECK(shard.tensor.scalar_type() == flat.whole.scalar_type(), "'", file, "': the flat parameter of ",
                    unit_name(prefix), " mixes ", flat.whole.scalar_type(), " and ", shard.tensor.scalar_type());
        flat.whole.narrow(0, shard.offsets[0], shard.sizes[0]).copy_(shard.tensor.reshape({-1}));
        flat.chunks.emplace_back(shard.offsets[0], shard.offsets[0] + shard.sizes[0]);
      }
    }
  }
  TORCH_CHECK(!flats.empty(), "'", files.front(), "' holds no FSDP1 flat parameter (", kFlatParam,
              "): not a LOCAL_STATE_DICT model file of FSDP1");
  // Every element of every flat parameter from exactly one chunk.
  for (auto& [prefix, flat] : flats) {
    std::sort(flat.chunks.begin(), flat.chunks.end());
    int64_t covered = 0;
    for (const auto& [begin, end] : flat.chunks) {
      TORCH_CHECK(begin == covered, "the flat parameter of ", unit_name(prefix), " in the ", world_size,
                  " LOCAL_STATE_DICT files from '", files.front(), "' ", begin < covered ? "overlaps" : "lacks",
                  " elements at ", std::min(begin, covered), ": the files are not one complete save");
      covered = end;
    }
    TORCH_CHECK(covered == flat.whole.size(0), "the flat parameter of ", unit_name(prefix), " has ", flat.whole.size(0),
                " elements, but the ", world_size, " files from '", files.front(), "' hold only ", covered,
                ": a rank's file is missing or from another save");
  }

  // Each parameter belongs to the deepest unit whose path contains it.
  std::map<std::string, std::vector<const ParameterShape*>> members;
  for (const auto& parameter : parameters) {
    const std::string* owner = nullptr;
    for (const auto& [prefix, flat] : flats) {
      const bool inside = prefix.empty() || (parameter.name.size() > prefix.size() &&
                                             parameter.name.compare(0, prefix.size(), prefix) == 0 &&
                                             parameter.name[prefix.size()] == '.');
      if (inside && (owner == nullptr || prefix.size() > owner->size())) owner = &prefix;
    }
    TORCH_CHECK(owner != nullptr, "the model's parameter '", parameter.name, "' is in none of the flat parameters of '",
                files.front(), "' (", flats.size(), " FSDP1 units, the first '", flats.begin()->first, ".",
                kFlatParam, "'): the checkpoint is of another model");
    members[*owner].push_back(&parameter);
  }
  std::map<std::string, at::Tensor> whole;
  for (const auto& [prefix, flat] : flats) {
    TORCH_CHECK(members.count(prefix), "the flat parameter of ", unit_name(prefix), " in '", files.front(),
                "' holds none of the model's parameters: the checkpoint is of another model");
    const auto& unit = members.at(prefix);
    std::vector<int64_t> numels;
    for (const auto* parameter : unit) {
      int64_t numel = 1;
      for (const auto size : parameter->shape) numel *= size;
      numels.push_back(numel);
    }
    const int64_t total = flat.whole.size(0);
    std::vector<std::vector<int64_t>> matches;
    std::vector<int64_t> totals;
    for (const int64_t aligned : {0, 2, 4, 8, 16}) {
      auto [offsets, size] = layout(numels, aligned, world_size);
      totals.push_back(size);
      if (size == total && std::find(matches.begin(), matches.end(), offsets) == matches.end()) matches.push_back(offsets);
    }
    TORCH_CHECK(!matches.empty(), "the flat parameter of ", unit_name(prefix), " holds ", total, " elements, but the ",
                unit.size(), " parameters of the model it covers (the first '", unit.front()->name, "') make ",
                totals[0], " without alignment and ", totals[1], ", ", totals[2], ", ", totals[3], " or ", totals[4],
                " with FSDP1's alignment on ", world_size, " ranks: the checkpoint is of another model or wrapping");
    TORCH_CHECK(matches.size() == 1, "the flat parameter of ", unit_name(prefix), " (", total, " elements) fits ",
                matches.size(), " FSDP1 layouts of the model's parameters (alignments that give the same total): which "
                "one was saved cannot be told. Save with SHARDED_STATE_DICT");
    for (size_t index = 0; index < unit.size(); ++index) {
      whole[unit[index]->name] = flat.whole.narrow(0, matches[0][index], numels[index]).view(unit[index]->shape);
    }
  }
  TensorList result;
  std::set<std::string> names;
  for (const auto& parameter : parameters) {
    result.emplace_back(parameter.name, whole.at(parameter.name));
    names.insert(parameter.name);
  }
  // The rest of rank 0's plain tensors are the buffers (a parameter's local piece under
  // use_orig_params has the parameter's name and is already taken from the flat parameter).
  for (auto& [name, tensor] : plain) {
    if (!names.count(name)) result.emplace_back(name, std::move(tensor));
  }
  return result;
}

}  // namespace fsdp::detail

#include "checkpoint/fsdp1_local_files.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/torch_file.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

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
std::pair<std::vector<int64_t>, int64_t> layout(const std::vector<int64_t>& numels, int64_t aligned,
                                                int64_t world_size) {
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
  std::vector<StateDictWithShardedTensors> states;
  for (const auto& file : files) states.push_back(load_state_dict_with_sharded_tensors(file));

  // The units: every flat parameter's path, from every file.
  const std::string suffix = kFlatParam;
  auto unit_of = [&](const std::string& name, const std::string& file) {
    TORCH_CHECK(name == suffix || (name.size() > suffix.size() + 1 &&
                                   name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                                   name[name.size() - suffix.size() - 1] == '.'),
                "'", file, "' holds a ShardedTensor '", name, "' that is not an FSDP1 flat parameter (<unit>.",
                kFlatParam, "): not a LOCAL_STATE_DICT model file of FSDP1");
    return name == suffix ? std::string() : name.substr(0, name.size() - suffix.size() - 1);
  };
  std::map<std::string, FlatParameter> flats;  // by unit path ("" for the root)
  for (size_t rank = 0; rank < files.size(); ++rank) {
    for (const auto& [name, sharded] : states[rank].sharded) flats.try_emplace(unit_of(name, files[rank]));
  }
  TORCH_CHECK(!flats.empty(), "'", files.front(), "' holds no FSDP1 flat parameter (", kFlatParam,
              "): not a LOCAL_STATE_DICT model file of FSDP1");

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
                files.front(), "' (", flats.size(), " FSDP1 units, the first '", flats.begin()->first, ".", kFlatParam,
                "'): the checkpoint is of another model");
    members[*owner].push_back(&parameter);
  }
  std::map<std::string, std::vector<int64_t>> numels;
  for (const auto& [prefix, flat] : flats) {
    TORCH_CHECK(members.count(prefix), "the flat parameter of ", unit_name(prefix), " in '", files.front(),
                "' holds none of the model's parameters: the checkpoint is of another model");
    for (const auto* parameter : members.at(prefix)) {
      int64_t numel = 1;
      for (const auto size : parameter->shape) numel *= size;
      numels[prefix].push_back(numel);
    }
  }

  // Put each flat parameter together. Its size comes from the file: it is held to the most the
  // unit's parameters can make (16-element alignment before each, world-size padding at the end)
  // before anything that large is allocated.
  for (size_t rank = 0; rank < files.size(); ++rank) {
    const auto& file = files[rank];
    for (const auto& [name, sharded] : states[rank].sharded) {
      const auto prefix = unit_of(name, file);
      auto& flat = flats.at(prefix);
      TORCH_CHECK(sharded.size.size() == 1, "'", file, "': the flat parameter of ", unit_name(prefix), " has ",
                  sharded.size.size(), " dimensions, expected 1");
      if (!flat.whole.defined()) {
        const auto& unit = numels.at(prefix);
        int64_t largest = world_size;
        for (const auto numel : unit) largest += numel + 15;
        TORCH_CHECK(sharded.size[0] <= largest, "'", file, "': the flat parameter of ", unit_name(prefix), " holds ",
                    sharded.size[0], " elements, more than the ", unit.size(),
                    " parameters of the model it covers can "
                    "make with any padding (",
                    largest, "): the checkpoint is of another model");
        const auto dtype =
            sharded.local_shards.empty() ? at::kFloat : sharded.local_shards.front().tensor.scalar_type();
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

  // Cut each flat parameter by the one FSDP1 layout its size allows.
  std::map<std::string, std::pair<int64_t, int64_t>> ranges;  // parameter -> [begin, end) in its unit's flat
  std::map<std::string, at::Tensor> whole;
  for (const auto& [prefix, flat] : flats) {
    const auto& unit = members.at(prefix);
    const auto& unit_numels = numels.at(prefix);
    const int64_t total = flat.whole.size(0);
    std::vector<std::vector<int64_t>> matches;
    std::vector<int64_t> totals;
    for (const int64_t aligned : {0, 2, 4, 8, 16}) {
      auto [offsets, size] = layout(unit_numels, aligned, world_size);
      totals.push_back(size);
      if (size == total && std::find(matches.begin(), matches.end(), offsets) == matches.end())
        matches.push_back(offsets);
    }
    TORCH_CHECK(!matches.empty(), "the flat parameter of ", unit_name(prefix), " holds ", total, " elements, but the ",
                unit.size(), " parameters of the model it covers (the first '", unit.front()->name, "') make ",
                totals[0], " without alignment and ", totals[1], ", ", totals[2], ", ", totals[3], " or ", totals[4],
                " with FSDP1's alignment on ", world_size, " ranks: the checkpoint is of another model or wrapping");
    TORCH_CHECK(matches.size() == 1, "the flat parameter of ", unit_name(prefix), " (", total, " elements) fits ",
                matches.size(),
                " FSDP1 layouts of the model's parameters (alignments that give the same total): which "
                "one was saved cannot be told. Save with SHARDED_STATE_DICT");
    for (size_t index = 0; index < unit.size(); ++index) {
      const auto begin = matches[0][index];
      whole[unit[index]->name] = flat.whole.narrow(0, begin, unit_numels[index]).view(unit[index]->shape);
      ranges[unit[index]->name] = {begin, begin + unit_numels[index]};
    }
  }

  // Under use_orig_params every rank's file also holds each parameter's piece in its chunk, under the
  // parameter's name: where it does, the cut must give the same values. A model that registers its
  // parameters in another order than the one saved (the total alone cannot tell) fails here.
  for (size_t rank = 0; rank < files.size(); ++rank) {
    std::map<std::string, const at::Tensor*> pieces;
    for (const auto& [name, tensor] : states[rank].tensors) pieces[name] = &tensor;
    for (const auto& [name, sharded] : states[rank].sharded) {
      const auto prefix = unit_of(name, files[rank]);
      for (const auto& shard : sharded.local_shards) {
        const int64_t chunk_begin = shard.offsets[0], chunk_end = shard.offsets[0] + shard.sizes[0];
        for (const auto* parameter : members.at(prefix)) {
          const auto piece = pieces.find(parameter->name);
          if (piece == pieces.end()) continue;
          const auto [begin, end] = ranges.at(parameter->name);
          const int64_t from = std::max(begin, chunk_begin), to = std::min(end, chunk_end);
          const auto expected = flats.at(prefix).whole.narrow(0, from, std::max<int64_t>(0, to - from));
          TORCH_CHECK(piece->second->numel() == expected.numel() &&
                          at::equal(piece->second->reshape({-1}).to(expected.scalar_type()), expected),
                      "'", files[rank], "': parameter '", parameter->name, "' as cut from the flat parameter of ",
                      unit_name(prefix), " differs from its own piece in the file (", piece->second->numel(),
                      " elements there, ", expected.numel(),
                      " cut): the model registers its parameters in another "
                      "order than the model that saved");
        }
      }
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
  for (auto& [name, tensor] : states.front().tensors) {
    if (!names.count(name)) result.emplace_back(name, std::move(tensor));
  }
  return result;
}

}  // namespace fsdp::detail

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fsdp/checkpoint.h>
#include <fsdp/collectives.h>
#include <fsdp/safetensors.h>
#include <fsdp/sharded_checkpoint.h>
#include <fsdp/state_dict.h>
#include <fsdp/torch_file.h>
#include <fsdp/version.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "checkpoint/accelerate_states.h"
#include "checkpoint/dcp_reader.h"
#include "checkpoint/dcp_writer.h"
#include "checkpoint/fsdp1_local_files.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/save_identity.h"
#include "checkpoint/sharded_directory.h"
#include "checkpoint/sharded_save.h"
#include "checkpoint/state_dict_views.h"
#include "dist/agreement.h"
#include "dist/control_channel.h"
#include "io/atomic_file.h"
#include "io/read_only_file.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMarker = "checkpoint_complete.json";
constexpr const char* kFullModelBin = "pytorch_model_fsdp.bin";
constexpr const char* kFullModelSafetensors = "pytorch_model_fsdp.safetensors";
constexpr const char* kFullOptimizer = "optimizer.bin";
constexpr const char* kShardedModel = "pytorch_model_fsdp_0";
constexpr const char* kShardedOptimizer = "optimizer_0";
constexpr const char* kScheduler = "scheduler.bin";
constexpr const char* kDataPosition = "dl_state_dict.bin";
constexpr const char* kSaveIdKey = "fsdp_cpp_save_id";
constexpr const char* kRankKey = "fsdp_cpp_rank";

std::string local_model_file(int64_t rank) { return "pytorch_model_fsdp_rank" + std::to_string(rank) + ".bin"; }
std::string random_states_file(int64_t rank) { return "random_states_" + std::to_string(rank) + ".pkl"; }

std::string path_in(const std::string& directory, const std::string& name) {
  return (fs::path(directory) / name).string();
}

using detail::message_of;

// Local file work between collectives must never leave the other ranks waiting.
void on_every_rank(const DistributedContext& context, const std::function<void()>& step) {
  detail::run_on_every_rank(context, step);
}

std::string canonical(const std::string& directory) { return fs::absolute(directory).lexically_normal().string(); }

StateDictType type_from_name(const std::string& name, const std::string& marker) {
  for (auto type : {StateDictType::kFullStateDict, StateDictType::kShardedStateDict, StateDictType::kLocalStateDict}) {
    if (name == to_string(type)) return type;
  }
  TORCH_CHECK(false, "'", marker, "' names an unknown state_dict_type '", name, "'");
}

void save_progress(const std::string& directory, const DistributedContext& context, const TrainingProgress& progress,
                   const std::string& save_id) {
  auto generator = at::detail::getDefaultCPUGenerator();
  at::Tensor generator_state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator_state = generator.get_state();
  }
  c10::impl::GenericDict random_states(c10::StringType::get(), c10::AnyType::get());
  random_states.insert("step", progress.step);
  random_states.insert("torch_manual_seed", generator_state);
  // Note [save identity]: which save and rank the generator belongs to.
  random_states.insert(kSaveIdKey, save_id);
  random_states.insert(kRankKey, context.rank());
  save_torch_file(path_in(directory, random_states_file(context.rank())), random_states);
  if (context.rank() != 0) return;
  c10::Dict<std::string, double> scheduler;
  for (const auto& [name, value] : progress.scheduler) scheduler.insert(name, value);
  save_torch_file(path_in(directory, kScheduler), scheduler);
  c10::impl::GenericDict data(c10::StringType::get(), c10::AnyType::get());
  data.insert("data_position", progress.data_position);
  save_torch_file(path_in(directory, kDataPosition), data);
}

TrainingProgress load_progress(const std::string& directory, const DistributedContext& context,
                               int64_t saved_world_size, int64_t marker_step, const std::string& save_id) {
  TrainingProgress progress;
  progress.step = marker_step;
  const auto scheduler = load_torch_file(path_in(directory, kScheduler));
  TORCH_CHECK(scheduler.isGenericDict(), "'", path_in(directory, kScheduler), "' is not a dict");
  for (const auto& entry : scheduler.toGenericDict()) {
    progress.scheduler[entry.key().toStringRef()] = entry.value().toDouble();
  }
  const auto data = load_torch_file(path_in(directory, kDataPosition));
  TORCH_CHECK(data.isGenericDict() && data.toGenericDict().contains("data_position"), "'",
              path_in(directory, kDataPosition), "' lacks data_position");
  progress.data_position = data.toGenericDict().at("data_position").toInt();
  // The generator continues exactly where this rank's was; a rank that did not exist when the
  // checkpoint was saved (more ranks now) keeps its own.
  if (context.rank() < saved_world_size) {
    const auto path = path_in(directory, random_states_file(context.rank()));
    const auto states = load_torch_file(path);
    TORCH_CHECK(states.isGenericDict() && states.toGenericDict().contains("torch_manual_seed"), "'", path,
                "' lacks torch_manual_seed");
    const auto& dict = states.toGenericDict();
    // Written before saves had identities: nothing to check.
    if (!save_id.empty() && dict.contains(kSaveIdKey)) {
      const auto recorded = dict.at(kSaveIdKey);
      const auto rank = dict.contains(kRankKey) ? dict.at(kRankKey) : c10::IValue();
      TORCH_CHECK(recorded.isString() && recorded.toStringRef() == save_id, "'", path, "' belongs to save ",
                  recorded.isString() ? recorded.toStringRef() : recorded.tagKind(), ", but the marker records save ",
                  save_id,
                  ": the file was copied from another checkpoint. Put back the files of one save, or load an "
                  "earlier checkpoint");
      TORCH_CHECK(rank.isInt() && rank.toInt() == context.rank(), "'", path, "' holds the generator of rank ",
                  rank.isInt() ? std::to_string(rank.toInt()) : rank.tagKind(), ", not ", context.rank(),
                  ": random-state files were swapped or renamed. Give each its own name back");
    }
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(states.toGenericDict().at("torch_manual_seed").toTensor());
  }
  return progress;
}

// Returns how many entries (tensors and byte items) the directory holds.
int64_t write_sharded_optimizer(const std::string& directory, const OptimizerStateDict& state,
                                const DistributedContext& context, const std::string& save_id) {
  std::vector<detail::DcpTensorEntry> tensors;
  std::vector<detail::DcpByteEntry> byte_items;
  detail::optimizer_dcp_entries(state, tensors, byte_items);
  detail::write_dcp_directory(directory, tensors, byte_items, context, save_id);
  return static_cast<int64_t>(tensors.size() + byte_items.size());
}

// Note [save identity]: a SHARDED directory of a checkpoint whose marker records a save must be of
// that save and hold as many entries as the save wrote.
void check_directory_of_save(const detail::ShardedDirectory& source, const std::string& name,
                             const nlohmann::json& marker, const std::string& marker_path) {
  if (!marker.contains("save_id") || !marker["save_id"].is_string()) return;  // saved before identities
  const auto save_id = marker["save_id"].get<std::string>();
  const auto recorded = source.save_id();
  TORCH_CHECK(recorded, source.description(), " is in the rank-file format, but '", marker_path, "' records DCP save ",
              save_id,
              ": the directory was replaced by one from an older checkpoint. Put back the files of one save, "
              "or load an earlier checkpoint");
  TORCH_CHECK(*recorded == save_id, source.description(), " belongs to save ",
              recorded->empty() ? std::string("(none recorded)") : *recorded, ", but '", marker_path, "' records save ",
              save_id,
              ": the directory was copied from another checkpoint. Put back the files of "
              "one save, or load an earlier checkpoint");
  if (marker.contains("entries") && marker["entries"].is_object() && marker["entries"].contains(name) &&
      marker["entries"][name].is_number_integer()) {
    const auto expected = marker["entries"][name].get<int64_t>();
    const auto found = source.entry_count();
    TORCH_CHECK(found == expected, source.description(), " lists ", found,
                " entries in its .metadata, but the save wrote ", expected, " (recorded in '", marker_path,
                "'): the .metadata is damaged. Load an earlier checkpoint");
  }
}

void load_optimizer_from_directory(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const detail::ShardedDirectory& source) {
  const auto groups = source.optimizer_groups(detail::optimizer_type(optimizer));
  TORCH_CHECK(groups, source.description(),
              " does not hold optimizer state (no optimizer and param_groups in its metadata)");
  load_optimizer_state_dict(model, optimizer, groups->optimizer, groups->json, source);
}

// Accelerate's save_state (FSDP2, SHARDED_STATE_DICT) writes no marker of ours. Its checkpoint is
// complete when both DCP directories have their .metadata (PyTorch writes it last, once every rank
// has written its file) and rank 0's random states exist (Accelerate writes them after the model
// and the optimizer, holding NumPy's generator, which fsdp.cpp's never hold: so an fsdp.cpp save
// that stopped before its marker is never taken for one of Accelerate's).
bool random_states_from_accelerate(const std::string& directory) {
  try {
    return detail::read_accelerate_random_states(path_in(directory, random_states_file(0))).holds_numpy_generator;
  } catch (const std::exception&) {
    return false;
  }
}

// optimizer.bin: fsdp.cpp's names its optimizer class; PyTorch's (Accelerate's FULL_STATE_DICT) does
// not, and its parameter groups tell (the same reading as its DCP optimizer directories).
OptimizerStateDict read_full_optimizer(const std::string& path, torch::optim::Optimizer& optimizer) {
  auto state = optimizer_state_dict_from_ivalue(load_torch_file(path), path);
  if (state.optimizer.empty()) {
    const auto groups = nlohmann::json::parse(state.param_groups_json);
    TORCH_CHECK(groups.is_array() && !groups.empty(), "optimizer file '", path, "' holds no parameter groups");
    for (const auto& group : groups) {
      auto type = detail::optimizer_type_of_param_group(group);
      TORCH_CHECK(!type.empty(), "optimizer file '", path, "': a parameter group has options ", group.dump(),
                  ", which are none of AdamW, Adam, SGD, Adagrad and RMSprop");
      // PyTorch's Adam and AdamW groups hold the same options unless "decoupled_weight_decay" is there
      // to tell them apart (it is not in every PyTorch's); without it, the optimizer loaded into decides.
      if (type == "AdamW" && !group.contains("decoupled_weight_decay") && detail::optimizer_type(optimizer) == "Adam") {
        type = "Adam";
      }
      TORCH_CHECK(state.optimizer.empty() || state.optimizer == type, "optimizer file '", path,
                  "': its parameter groups are of ", state.optimizer, " and ", type);
      state.optimizer = type;
      detail::check_pytorch_only_options(type, group, "optimizer file '" + path + "'");
    }
  }
  return state;
}

// Which complete checkpoint of Accelerate's save_state `directory` holds, found by one probe (rank
// 0's random states, a pickle, are read once and only when the files of a layout are there):
//   - kSharded (SHARDED_STATE_DICT): both DCP directories with their .metadata.
//   - kFull (FULL_STATE_DICT): rank 0's torch.save of the full model state dict (an OrderedDict,
//     read through the restricted unpickler: Note [torch files through the restricted unpickler])
//     and of the full optimizer state dict keyed by parameter names.
//   - kLocal (LOCAL_STATE_DICT, FSDP1 only): each rank's pytorch_model_fsdp_rank<r>.bin (ShardedTensor
//     flat parameters: Note [FSDP1 flat parameters]) and the DCP optimizer_0/ of SHARDED_STATE_DICT.
//     Our own LOCAL saves use the same file names, but with their marker.
enum class AccelerateLayout { kNone, kSharded, kFull, kLocal };

AccelerateLayout accelerate_layout(const std::string& directory) {
  std::error_code error;
  if (fs::exists(path_in(directory, kMarker), error)) return AccelerateLayout::kNone;
  const bool optimizer_directory =
      detail::sharded_directory_format(path_in(directory, kShardedOptimizer)) == detail::ShardedFormat::kDcp;
  auto layout = AccelerateLayout::kNone;
  if (optimizer_directory &&
      detail::sharded_directory_format(path_in(directory, kShardedModel)) == detail::ShardedFormat::kDcp) {
    layout = AccelerateLayout::kSharded;
  } else if (fs::is_regular_file(path_in(directory, kFullModelBin), error) &&
             fs::is_regular_file(path_in(directory, kFullOptimizer), error)) {
    layout = AccelerateLayout::kFull;
  } else if (optimizer_directory && fs::is_regular_file(path_in(directory, local_model_file(0)), error)) {
    layout = AccelerateLayout::kLocal;
  }
  return layout != AccelerateLayout::kNone && random_states_from_accelerate(directory) ? layout
                                                                                       : AccelerateLayout::kNone;
}

int64_t count_random_states(const std::string& directory) {
  int64_t count = 0;
  std::error_code error;
  while (count < (int64_t{1} << 20) && fs::is_regular_file(path_in(directory, random_states_file(count)), error))
    ++count;
  return count;
}

// The loaded optimizer's step count: the first parameter state's "step" (they are all equal after
// optimizer steps), or nullopt for an optimizer without one. Views: nothing is copied.
std::optional<int64_t> loaded_step(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  for (const auto& [name, tensor] : detail::sharded_optimizer_state_dict_views(model, optimizer).tensors) {
    if (name.size() < 5 || name.compare(name.size() - 5, 5, ".step") != 0) continue;
    return static_cast<int64_t>(tensor.local.item<double>());  // checked when it was loaded
  }
  return std::nullopt;
}

// The progress of a checkpoint Accelerate wrote: the optimizer's step count (Accelerate's own
// "step" counts micro-steps of gradient accumulation, not optimizer steps), this rank's CPU
// generator, and the names of everything that cannot be restored here, in one warning.
TrainingProgress load_accelerate_progress(const std::string& directory, const DistributedContext& context,
                                          int64_t saved_world_size, std::optional<int64_t> step) {
  TrainingProgress progress;
  std::vector<std::string> not_restored;
  progress.step = step.value_or(0);
  if (!step) not_restored.push_back("the step count (the optimizer keeps none; resumed at step 0)");
  if (context.rank() < saved_world_size) {
    const auto path = path_in(directory, random_states_file(context.rank()));
    auto states = detail::read_accelerate_random_states(path);
    if (states.torch_cpu_state.defined()) {
      auto generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      try {
        generator.set_state(states.torch_cpu_state);
      } catch (const c10::Error& failure) {
        TORCH_CHECK(false, "'", path, "': torch_manual_seed is not a CPU generator state (",
                    failure.what_without_backtrace(), ")");
      }
    } else {
      not_restored.push_back(random_states_file(context.rank()) + " holds no torch_manual_seed");
    }
    for (const auto& entry : states.not_restored)
      not_restored.push_back(random_states_file(context.rank()) + ": " + entry);
  }
  const std::vector<std::pair<std::string, std::string>> others = {
      {kScheduler,
       "a PyTorch LR scheduler's state; fsdp.cpp has none of PyTorch's schedulers, so set the learning "
       "rate of the resumed step yourself"},
      {"sampler.bin", "a data sampler's state"},
      {kDataPosition, "a stateful data loader's position"},
      {"scaler.pt", "a gradient scaler's state"}};
  for (const auto& [file, what] : others) {
    if (fs::exists(path_in(directory, file))) not_restored.push_back(file + " (" + what + ")");
  }
  for (const auto& item : fs::directory_iterator(directory)) {
    const auto name = item.path().filename().string();
    if (name.rfind("custom_checkpoint_", 0) == 0)
      not_restored.push_back(name + " (an object registered for checkpointing)");
  }
  progress.not_restored = not_restored;
  if (context.rank() == 0 && !not_restored.empty()) {
    std::string text = "checkpoint '" + directory + "' was written by Accelerate; resumed at optimizer step " +
                       std::to_string(progress.step) + " with its model and optimizer. Not restored:";
    for (const auto& entry : not_restored) text += "\n  - " + entry;
    TORCH_WARN(text);
  }
  return progress;
}

}  // namespace

bool is_complete_checkpoint(const std::string& directory) {
  return fs::exists(path_in(directory, kMarker)) || accelerate_layout(directory) != AccelerateLayout::kNone;
}

namespace {

// For an error about `directory`: the complete checkpoints beside it (its parent's subdirectories),
// newest name last, so the message can offer the ones that would load. At most the 5 last by name.
std::string complete_checkpoints_beside(const std::string& directory) {
  const auto parent = fs::path(directory).lexically_normal().parent_path();
  std::error_code failure;
  if (!parent.empty() && !fs::is_directory(parent, failure)) return " '" + parent.string() + "' does not exist either.";
  std::vector<std::string> found;
  for (const auto& item : fs::directory_iterator(parent.empty() ? fs::path(".") : parent, failure)) {
    if (item.is_directory(failure) && is_complete_checkpoint(item.path().string()))
      found.push_back(item.path().string());
  }
  if (found.empty()) return " No complete checkpoint is beside it in '" + parent.string() + "'.";
  // checkpoint_<i> names sort by i; others by name.
  auto number = [](const std::string& path) -> int64_t {
    const auto name = fs::path(path).filename().string();
    const std::string prefix = "checkpoint_";
    if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 18) return -1;
    for (size_t index = prefix.size(); index < name.size(); ++index) {
      if (name[index] < '0' || name[index] > '9') return -1;
    }
    return std::stoll(name.substr(prefix.size()));
  };
  std::sort(found.begin(), found.end(), [&](const std::string& a, const std::string& b) {
    return std::make_pair(number(a), a) < std::make_pair(number(b), b);
  });
  if (found.size() > 5) found.erase(found.begin(), found.end() - 5);
  std::string list;
  for (const auto& path : found) list += (list.empty() ? "" : ", ") + ("'" + path + "'");
  return " Complete checkpoints beside it: " + list +
         " (Accelerator::latest_checkpoint() returns the newest automatic one).";
}

}  // namespace

namespace {

// What every save does before its files: the directory stops counting as a checkpoint, and every
// rank agrees on the call. Returns the save's id, rank 0's (Note [save identity]). Two collectives;
// the caller creates the directory.
std::string begin_save(const std::string& directory, const DistributedContext& context) {
  const bool main = context.rank() == 0;
  // An overwritten directory counts as incomplete until this save has finished everywhere: neither
  // our marker nor Accelerate's random states (which make a directory one of Accelerate's complete
  // checkpoints) may survive from what was there.
  if (main && fs::exists(path_in(directory, kMarker))) fs::remove(path_in(directory, kMarker));
  if (main && random_states_from_accelerate(directory)) fs::remove(path_in(directory, random_states_file(0)));
  detail::agree_on_operation(context, "save_checkpoint('" + canonical(directory) + "')");
  // Note [save identity]: rank 0 chooses the id, and every rank's files record it.
  return detail::share_save_id(context);
}

// Rank 0 writes the marker; called once every rank has written everything.
void write_marker(const std::string& directory, const DistributedContext& context, StateDictType type, int64_t step,
                  const std::string& save_id, const nlohmann::json& entries, const std::string& model_file) {
  if (context.rank() != 0) return;
  nlohmann::json marker;
  marker["state_dict_type"] = to_string(type);
  marker["world_size"] = context.world_size();
  marker["step"] = step;
  marker["fsdp_cpp_version"] = version();
  marker["save_id"] = save_id;
  if (!entries.empty()) marker["entries"] = entries;
  if (!model_file.empty()) marker["model_file"] = model_file;
  detail::write_file_atomically(path_in(directory, kMarker), marker.dump(1));
}

}  // namespace

namespace detail {

ShardedSave begin_sharded_save(const std::string& directory, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer, const DistributedContext& context,
                               const TrainingProgress& progress) {
  ShardedSave save;
  save.directory = directory;
  // Note [metadata pieces]: two collectives here and one in the step below, of the save's five.
  save.save_id = begin_save(directory, context);
  save.step = progress.step;
  save.model = model_dcp_entries(sharded_model_state_dict_views(model));
  optimizer_dcp_entries(sharded_optimizer_state_dict_views(model, optimizer), save.optimizer, save.optimizer_bytes);
  // One step: rank 0 clears what an earlier checkpoint left in the DCP directories while every rank
  // creates them (rank 0 too, after clearing: no rank writes there before the step's end), and the
  // generator as it is now, when the state is taken, and the progress (a few bytes: written here).
  on_every_rank(context, [&] {
    for (const auto* name : {kShardedModel, kShardedOptimizer}) {
      if (context.rank() == 0) clear_dcp_directory(path_in(directory, name));
      create_dcp_directory(path_in(directory, name));
    }
    save_progress(directory, context, progress, save.save_id);
  });
  return save;
}

std::array<std::string, 2> write_sharded_save_files(const ShardedSave& save, int64_t rank, int64_t world_size) {
  return {write_dcp_rank_file(path_in(save.directory, kShardedModel), save.model, {}, rank, world_size, save.save_id),
          write_dcp_rank_file(path_in(save.directory, kShardedOptimizer), save.optimizer, save.optimizer_bytes, rank,
                              world_size, save.save_id)};
}

void finish_sharded_save(const ShardedSave& save, const std::array<std::string, 2>& reports,
                         const DistributedContext& context) {
  // Note [metadata pieces]: the last two collectives: every rank's files are written, then rank 0
  // joins both directories' pieces and writes the marker.
  const auto model_directory = path_in(save.directory, kShardedModel);
  const auto optimizer_directory = path_in(save.directory, kShardedOptimizer);
  auto error = dcp_write_error(model_directory, context.rank(), reports[0]);
  const auto optimizer_error = dcp_write_error(optimizer_directory, context.rank(), reports[1]);
  error += (error.empty() || optimizer_error.empty() ? "" : "; ") + optimizer_error;
  raise_if_any_rank_failed(context, error);
  nlohmann::json entries = nlohmann::json::object();
  entries[kShardedModel] = save.model.size();
  entries[kShardedOptimizer] = save.optimizer.size() + save.optimizer_bytes.size();
  on_every_rank(context, [&] {
    if (context.rank() != 0) return;
    write_dcp_metadata(model_directory, save.model, {}, context.world_size(), save.save_id);
    write_dcp_metadata(optimizer_directory, save.optimizer, save.optimizer_bytes, context.world_size(), save.save_id);
    write_marker(save.directory, context, StateDictType::kShardedStateDict, save.step, save.save_id, entries, "");
  });
}

}  // namespace detail

void save_checkpoint(const std::string& directory, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const DistributedContext& context, const TrainingProgress& progress,
                     const CheckpointOptions& options) {
  if (options.state_dict_type == StateDictType::kShardedStateDict) {
    // The views of the live state are written as they are: nothing changes them meanwhile.
    const auto save = detail::begin_sharded_save(directory, model, optimizer, context, progress);
    detail::finish_sharded_save(save, detail::write_sharded_save_files(save, context.rank(), context.world_size()),
                                context);
    return;
  }
  const bool main = context.rank() == 0;
  const std::string save_id = begin_save(directory, context);
  on_every_rank(context, [&] { fs::create_directories(directory); });
  std::string model_file;
  nlohmann::json entries = nlohmann::json::object();
  if (options.state_dict_type == StateDictType::kFullStateDict) {
    auto model_state = full_model_state_dict(model, options.state_dict_config);
    auto optimizer_state = full_optimizer_state_dict(model, optimizer, options.optim_state_dict_config);
    model_file = options.full_model_safetensors ? kFullModelSafetensors : kFullModelBin;
    on_every_rank(context, [&] {
      if (!main) return;
      // The other variant of an earlier save in this directory must not be mistaken for this one.
      fs::remove(path_in(directory, options.full_model_safetensors ? kFullModelBin : kFullModelSafetensors));
      if (options.full_model_safetensors) {
        write_safetensors(path_in(directory, kFullModelSafetensors), model_state);
      } else {
        save_torch_file(path_in(directory, kFullModelBin), tensor_dict(model_state));
      }
      save_torch_file(path_in(directory, kFullOptimizer), optimizer_state_dict_to_ivalue(optimizer_state));
    });
  } else {
    const auto state = local_model_state_dict(model);
    on_every_rank(context,
                  [&] { save_torch_file(path_in(directory, local_model_file(context.rank())), tensor_dict(state)); });
    entries[kShardedOptimizer] =
        write_sharded_optimizer(path_in(directory, kShardedOptimizer),
                                detail::sharded_optimizer_state_dict_views(model, optimizer), context, save_id);
  }
  on_every_rank(context, [&] { save_progress(directory, context, progress, save_id); });
  on_every_rank(context, [&] {
    write_marker(directory, context, options.state_dict_type, progress.step, save_id, entries, model_file);
  });
}

TrainingProgress load_checkpoint(const std::string& directory, torch::nn::Module& model,
                                 torch::optim::Optimizer& optimizer, const DistributedContext& context,
                                 const CheckpointOptions& options) {
  // An empty path is what latest_checkpoint() returns when there is none yet.
  TORCH_CHECK(!directory.empty(), "load_checkpoint: the checkpoint directory is \"\" (an empty path; ",
              "Accelerator::latest_checkpoint() returns that when no complete checkpoint exists yet). Load only when ",
              "there is one: if (auto latest = accelerator.latest_checkpoint(); !latest.empty()) ",
              "accelerator.load_state(latest);");
  detail::agree_on_operation(context, "load_checkpoint('" + canonical(directory) + "')");
  StateDictType type = StateDictType::kShardedStateDict;
  int64_t saved_world_size = 0;
  int64_t step = 0;
  std::unique_ptr<TensorSource> model_reader;
  std::unique_ptr<detail::ShardedDirectory> optimizer_reader;
  std::string model_file;
  std::unique_ptr<TensorListSource> full_source;
  std::optional<OptimizerStateDict> full_optimizer;
  const bool model_from_rank0 = options.state_dict_config.rank0_only;
  const bool optimizer_from_rank0 = options.optim_state_dict_config.rank0_only;
  bool written_by_accelerate = false;
  nlohmann::json marker = nlohmann::json::object();
  std::string save_id;  // what the marker records (Note [save identity]), empty before identities
  std::string error;
  try {
    const auto marker_path = path_in(directory, kMarker);
    TORCH_CHECK(fs::is_directory(directory), "checkpoint directory '", directory, "' does not exist.",
                complete_checkpoints_beside(directory));
    // FULL: the model file and optimizer.bin (rank0_only: rank 0 alone reads them, and the others
    // receive their rows).
    auto read_full_files = [&](const std::string& recorded) {
      model_file = path_in(directory, recorded);
      TORCH_CHECK(fs::exists(model_file), "checkpoint directory '", directory, "' lacks ", recorded);
      TORCH_CHECK(fs::exists(path_in(directory, kFullOptimizer)), "checkpoint directory '", directory, "' lacks ",
                  kFullOptimizer);
      if (context.rank() == 0 || !model_from_rank0) {
        TensorList tensors;
        if (recorded == kFullModelSafetensors) {
          tensors = read_safetensors(model_file);
        } else {
          tensors = tensor_dict_items(load_torch_file(model_file), model_file);
        }
        full_source = std::make_unique<TensorListSource>(std::move(tensors), "'" + model_file + "'");
      }
      if (context.rank() == 0 && optimizer_from_rank0) {
        full_optimizer = read_full_optimizer(path_in(directory, kFullOptimizer), optimizer);
      }
    };
    const auto layout = accelerate_layout(directory);
    if (layout == AccelerateLayout::kSharded) {
      written_by_accelerate = true;
      saved_world_size = count_random_states(directory);
      model_reader = detail::open_sharded_directory(path_in(directory, kShardedModel));
      optimizer_reader = detail::open_sharded_directory(path_in(directory, kShardedOptimizer));
    } else if (layout == AccelerateLayout::kFull) {
      written_by_accelerate = true;
      type = StateDictType::kFullStateDict;
      saved_world_size = count_random_states(directory);
      read_full_files(kFullModelBin);
    } else if (layout == AccelerateLayout::kLocal) {
      // Every rank rebuilds the whole parameters from every rank's file, and loads its own rows.
      written_by_accelerate = true;
      saved_world_size = count_random_states(directory);
      std::vector<std::string> files;
      for (int64_t rank = 0; rank < saved_world_size; ++rank) {
        files.push_back(path_in(directory, local_model_file(rank)));
        TORCH_CHECK(fs::is_regular_file(files.back()), "checkpoint directory '", directory, "' holds ",
                    saved_world_size, " ranks' random states (Accelerate's LOCAL_STATE_DICT) but lacks ",
                    local_model_file(rank), ": the save did not finish on every rank. Load an earlier checkpoint");
      }
      const auto parameter_names = model.named_parameters();
      std::vector<detail::ParameterShape> parameters;
      for (const auto& [name, tensor] : detail::sharded_model_state_dict_views(model)) {
        if (parameter_names.contains(name)) parameters.push_back({name, tensor.global_shape});
      }
      model_reader = std::make_unique<TensorListSource>(
          detail::full_state_dict_from_fsdp1_local_files(files, parameters),
          "Accelerate's LOCAL_STATE_DICT files " + local_model_file(0) + ".. in '" + directory + "'");
      optimizer_reader = detail::open_sharded_directory(path_in(directory, kShardedOptimizer));
    } else {
      TORCH_CHECK(fs::exists(marker_path) || !random_states_from_accelerate(directory), "checkpoint directory '",
                  directory, "' was written by Accelerate (its ", random_states_file(0),
                  " holds NumPy's generator), but not as a complete SHARDED_STATE_DICT, FULL_STATE_DICT or "
                  "LOCAL_STATE_DICT checkpoint: fsdp.cpp resumes Accelerate's checkpoints whose ",
                  kShardedModel, "/ and ", kShardedOptimizer, "/ are DCP directories with their .metadata, which hold ",
                  kFullModelBin, " and ", kFullOptimizer, ", or each rank's ", local_model_file(0), " and ",
                  kShardedOptimizer, "/. Load an earlier checkpoint, or only the weights");
      TORCH_CHECK(fs::exists(marker_path), "checkpoint directory '", directory, "' is incomplete: ", kMarker,
                  " is missing, so the save that wrote it did not finish on every rank (or this is not a checkpoint). "
                  "Load an earlier checkpoint.",
                  complete_checkpoints_beside(directory));
      try {
        // The marker is a line of JSON.
        marker = nlohmann::json::parse(detail::read_text_file(marker_path, uint64_t{1} << 20, "checkpoint marker"));
      } catch (const nlohmann::json::exception& failure) {
        TORCH_CHECK(false, "'", marker_path, "' is not valid JSON (", failure.what(), ")");
      }
      TORCH_CHECK(marker.is_object() && marker.contains("state_dict_type") && marker["state_dict_type"].is_string() &&
                      marker.contains("world_size") && marker["world_size"].is_number_integer() &&
                      (!marker.contains("step") || marker["step"].is_number_integer()),
                  "'", marker_path, "' lacks state_dict_type (a string), world_size or step (integers)");
      type = type_from_name(marker["state_dict_type"].get<std::string>(), marker_path);
      saved_world_size = marker["world_size"].get<int64_t>();
      step = marker.value("step", int64_t{0});
      if (marker.contains("save_id") && marker["save_id"].is_string()) save_id = marker["save_id"].get<std::string>();
      TORCH_CHECK(step >= 0 && saved_world_size >= 1, "'", marker_path, "' says step ", step, " and world_size ",
                  saved_world_size,
                  "; a checkpoint has a step of 0 or more and at least one rank. The marker is damaged: "
                  "load an earlier checkpoint");
      if (type == StateDictType::kFullStateDict) {
        const std::string recorded = marker.contains("model_file") && marker["model_file"].is_string()
                                         ? marker["model_file"].get<std::string>()
                                         : std::string(kFullModelBin);
        TORCH_CHECK(recorded == kFullModelBin || recorded == kFullModelSafetensors, "'", marker_path,
                    "' names model file '", recorded, "'");
        read_full_files(recorded);
      } else {
        if (type == StateDictType::kShardedStateDict) {
          auto model_directory = detail::open_sharded_directory(path_in(directory, kShardedModel));
          check_directory_of_save(*model_directory, kShardedModel, marker, marker_path);
          model_reader = std::move(model_directory);
        } else {
          TORCH_CHECK(saved_world_size == context.world_size(), "checkpoint directory '", directory,
                      "' holds a LOCAL_STATE_DICT saved by ", saved_world_size, " ranks; it loads only on ",
                      saved_world_size, " ranks, not ", context.world_size(),
                      ". Save with SHARDED_STATE_DICT to change the number of ranks");
          model_file = path_in(directory, local_model_file(context.rank()));
          TORCH_CHECK(fs::exists(model_file), "checkpoint directory '", directory, "' lacks ",
                      local_model_file(context.rank()));
        }
        optimizer_reader = detail::open_sharded_directory(path_in(directory, kShardedOptimizer));
        check_directory_of_save(*optimizer_reader, kShardedOptimizer, marker, marker_path);
      }
    }
  } catch (const std::exception& failure) {
    error = message_of(failure);
  }
  detail::raise_if_any_rank_failed(context, error);

  // The collectives (FULL from rank 0) come first; everything after is local and checked on every rank.
  if (type == StateDictType::kFullStateDict && model_from_rank0) {
    load_model_state_dict_from_rank0(model, context, full_source.get());
    full_source.reset();
  }
  if (type == StateDictType::kFullStateDict && optimizer_from_rank0) {
    load_optimizer_state_dict_from_rank0(model, optimizer, context, full_optimizer ? &*full_optimizer : nullptr);
    full_optimizer.reset();
  }
  TrainingProgress progress;
  on_every_rank(context, [&] {
    switch (type) {
      case StateDictType::kFullStateDict: {
        if (full_source) load_model_state_dict(model, *full_source);
        full_source.reset();
        if (optimizer_from_rank0) break;
        const auto optimizer_path = path_in(directory, kFullOptimizer);
        const auto state = read_full_optimizer(optimizer_path, optimizer);
        TensorList tensors;
        for (const auto& [name, tensor] : state.tensors) tensors.emplace_back(name, tensor.local);
        load_optimizer_state_dict(model, optimizer, state.optimizer, state.param_groups_json,
                                  TensorListSource(std::move(tensors), "'" + optimizer_path + "'"));
        break;
      }
      case StateDictType::kShardedStateDict:
        load_model_state_dict(model, *model_reader);
        load_optimizer_from_directory(model, optimizer, *optimizer_reader);
        break;
      case StateDictType::kLocalStateDict:
        load_local_model_state_dict(model, tensor_dict_items(load_torch_file(model_file), model_file));
        load_optimizer_from_directory(model, optimizer, *optimizer_reader);
        break;
    }
    progress = written_by_accelerate
                   ? load_accelerate_progress(directory, context, saved_world_size, loaded_step(model, optimizer))
                   : load_progress(directory, context, saved_world_size, step, save_id);
  });
  return progress;
}

}  // namespace fsdp

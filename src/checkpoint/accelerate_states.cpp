#include "checkpoint/accelerate_states.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <set>

#include "io/read_only_file.h"
#include "io/restricted_unpickler.h"

namespace fsdp::detail {
namespace {

using Kind = PickleValue::Kind;

constexpr uint64_t kMaxFileBytes = uint64_t{64} << 20;

const std::set<std::string>& accelerate_state_globals() {
  static const std::set<std::string> names = {
      kPersistentLoad, "torch._utils._rebuild_tensor_v2", "torch.ByteStorage", "collections.OrderedDict",
      // NumPy's generator state and the bytes inside it: named, never built.
      "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
      "_codecs.encode"};
  return names;
}

// What each entry Accelerate writes is, for the warning about those not restored.
std::string describe_entry(const std::string& key) {
  if (key == "random_state") return "random_state (Python's random module)";
  if (key == "numpy_random_seed") return "numpy_random_seed (NumPy's generator)";
  if (key.rfind("torch_", 0) == 0 && key != "torch_manual_seed") return key + " (a device's generators)";
  return key;
}

}  // namespace

AccelerateRandomStates read_accelerate_random_states(const std::string& path) {
  // Accelerate's random states are a few kilobytes.
  const auto bytes = ReadOnlyFile(path, kMaxFileBytes, "random states file").read_all();
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  at::DataPtr pickle;
  size_t pickle_size = 0;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size())));
    std::tie(pickle, pickle_size) = archive->getRecord("data.pkl");
  } catch (const c10::Error& failure) {
    TORCH_CHECK(false, "'", path, "' is not a torch.save archive: ", failure.what_without_backtrace());
  }
  const auto document =
      restricted_unpickle(static_cast<const uint8_t*>(pickle.get()), pickle_size, accelerate_state_globals(), path);
  const auto& root = *document.root;
  TORCH_CHECK(root.kind == Kind::kDict, "'", path, "' holds a ", root.describe(),
              ", expected Accelerate's dict of states");
  AccelerateRandomStates states;
  for (size_t index = 0; index + 1 < root.items.size(); index += 2) {
    const auto& key_value = *root.items[index];
    TORCH_CHECK(key_value.kind == Kind::kString, "'", path, "' has a key that is a ", key_value.describe());
    const auto& key = key_value.text;
    const auto& value = *root.items[index + 1];
    const std::string where = "'" + path + "' entry '" + key + "'";
    if (key == "step") {
      TORCH_CHECK(value.kind == Kind::kInt && value.integer >= 0, where, " is a ", value.describe(),
                  ", expected a non-negative integer");
      states.step = value.integer;
    } else if (key == "torch_manual_seed") {
      // _rebuild_tensor_v2(persistent_load(("storage", torch.ByteStorage, key, location, numel)),
      //                    offset, size, stride, requires_grad, OrderedDict())
      TORCH_CHECK(value.kind == Kind::kObject && value.callee->text == "torch._utils._rebuild_tensor_v2" &&
                      value.arguments->items.size() >= 4,
                  where, " is a ", value.describe(), ", expected a tensor");
      const auto& arguments = value.arguments->items;
      const auto* storage = arguments[0];
      TORCH_CHECK(storage->kind == Kind::kObject && storage->callee->text == kPersistentLoad &&
                      storage->arguments->items.size() == 1 && storage->arguments->items[0]->kind == Kind::kTuple,
                  where, " has no storage reference");
      const auto& reference = storage->arguments->items[0]->items;
      TORCH_CHECK(reference.size() == 5 && reference[1]->kind == Kind::kGlobal &&
                      reference[1]->text == "torch.ByteStorage" && reference[2]->kind == Kind::kString &&
                      reference[4]->kind == Kind::kInt,
                  where, " is not a uint8 tensor (torch.get_rng_state())");
      const int64_t numel = reference[4]->integer;
      const auto* offset = arguments[1];
      const auto* size = arguments[2];
      TORCH_CHECK(offset->kind == Kind::kInt && offset->integer == 0 && size->kind == Kind::kTuple &&
                      size->items.size() == 1 && size->items[0]->kind == Kind::kInt &&
                      size->items[0]->integer == numel && numel > 0 && static_cast<uint64_t>(numel) <= kMaxFileBytes,
                  where, " is not a whole one-dimensional tensor of its storage");
      at::DataPtr data;
      size_t data_size = 0;
      try {
        std::tie(data, data_size) = archive->getRecord("data/" + reference[2]->text);
      } catch (const c10::Error& failure) {
        TORCH_CHECK(false, where, ": its storage record 'data/", reference[2]->text,
                    "' cannot be read: ", failure.what_without_backtrace());
      }
      TORCH_CHECK(static_cast<int64_t>(data_size) == numel, where, ": its storage holds ", data_size, " bytes, not ",
                  numel);
      states.torch_cpu_state = at::empty({numel}, at::kByte);
      std::memcpy(states.torch_cpu_state.data_ptr(), data.get(), data_size);
    } else {
      states.holds_numpy_generator = states.holds_numpy_generator || key == "numpy_random_seed";
      states.not_restored.push_back(describe_entry(key));
    }
  }
  return states;
}

}  // namespace fsdp::detail

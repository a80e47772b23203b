// Any bytes into the restricted unpickler, with every global the project's readers allow (DCP's
// classes and Accelerate's random states): the only acceptable outcomes are a document or a
// c10::Error; a crash, a sanitizer report, a hang or memory beyond libFuzzer's limit is a bug.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "io/restricted_unpickler.h"

namespace {

const std::set<std::string>& allowed() {
  static const std::set<std::string> names = {fsdp::detail::kPersistentLoad,
                                              "torch._utils._rebuild_tensor_v2",
                                              "torch.ByteStorage",
                                              "collections.OrderedDict",
                                              "numpy._core.multiarray._reconstruct",
                                              "numpy.ndarray",
                                              "numpy.dtype",
                                              "_codecs.encode",
                                              "torch.distributed.checkpoint.metadata.Metadata",
                                              "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
                                              "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
                                              "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
                                              "torch.distributed.checkpoint.metadata.MetadataIndex",
                                              "torch.distributed.checkpoint.metadata.TensorProperties",
                                              "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
                                              "torch.distributed.checkpoint.metadata.StorageMeta",
                                              "torch.distributed.checkpoint.filesystem._StorageInfo",
                                              "torch.Size",
                                              "torch.serialization._get_layout",
                                              "torch.strided",
                                              "torch.float32",
                                              "pathlib.PosixPath"};
  return names;
}

// Visits every value once, as the readers do, with an explicit stack (no recursion).
size_t walk(const fsdp::detail::PickleValue* root) {
  std::set<const fsdp::detail::PickleValue*> seen;
  std::vector<const fsdp::detail::PickleValue*> stack{root};
  while (!stack.empty()) {
    const auto* value = stack.back();
    stack.pop_back();
    if (!value || !seen.insert(value).second) continue;
    (void)value->describe();
    for (const auto* item : value->items) stack.push_back(item);
    stack.push_back(value->callee);
    stack.push_back(value->arguments);
    stack.push_back(value->state);
  }
  return seen.size();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto document = fsdp::detail::restricted_unpickle(data, size, allowed(), "fuzz input");
    walk(document.root);
  } catch (const c10::Error&) {
  }
  return 0;
}

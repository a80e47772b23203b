// Any bytes as a safetensors file: a SafetensorsHeader whose tensors tile the data section exactly
// (in order, no gaps, no overlaps, each spanning numel x element size bytes, the last ending at the
// end of the file) and whose index finds each of them, or a c10::Error. A file that parses is then
// read back through SafetensorsReader, from a per-process file, and every tensor it returns must
// have the header's shape and dtype; anything else (a crash, a sanitizer report, a hang, runaway
// memory) is a bug.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/safetensors.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

namespace {

// Per process: libFuzzer's -jobs/-workers run several of these side by side.
std::string scratch_name() { return "/tmp/fsdp_safetensors_fuzz_" + std::to_string(::getpid()) + ".safetensors"; }

const std::string& scratch_path() {
  static const std::string path = [] {
    // The exit handler runs after `path` is destroyed, so it builds the name again.
    std::atexit([] { std::remove(scratch_name().c_str()); });
    return scratch_name();
  }();
  return path;
}

void write_scratch(const uint8_t* data, size_t size) {
  std::FILE* file = std::fopen(scratch_path().c_str(), "wb");
  if (!file) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, file) != size) std::abort();
  if (std::fclose(file) != 0) std::abort();
}

void check_header(const fsdp::SafetensorsHeader& header, size_t size) {
  if (header.data_offset < 8 || static_cast<uint64_t>(header.data_offset) > size) std::abort();
  if (header.index.size() != header.tensors.size()) std::abort();
  int64_t expected_begin = 0;
  std::set<std::string> names;
  for (size_t position = 0; position < header.tensors.size(); ++position) {
    const auto& tensor = header.tensors[position];
    if (!names.insert(tensor.name).second || tensor.name == "__metadata__") std::abort();
    if (tensor.begin != expected_begin || tensor.end < tensor.begin) std::abort();
    if (tensor.end - tensor.begin != fsdp::safetensors_byte_size(tensor.dtype, tensor.shape)) std::abort();
    if (header.find(tensor.name) != &tensor || header.index.at(tensor.name) != position) std::abort();
    expected_begin = tensor.end;
  }
  if (static_cast<uint64_t>(header.data_offset + expected_begin) != size) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdp::SafetensorsHeader header;
  try {
    header = fsdp::parse_safetensors(data, size, "fuzz input");
  } catch (const c10::Error&) {
    return 0;
  }
  check_header(header, size);
  // The reader maps the file and reads each tensor with pread, a path of its own worth covering too.
  write_scratch(data, size);
  // The bytes parsed in memory, so opening them as a file must succeed: no try here.
  fsdp::SafetensorsReader reader(scratch_path());
  if (reader.header().tensors.size() != header.tensors.size()) std::abort();
  for (const auto& info : header.tensors) {
    at::Tensor tensor;
    try {
      tensor = reader.tensor(info.name);
    } catch (const c10::Error&) {
      // Sub-byte dtypes (F4, F6_*) parse but do not load, and a BOOL tensor's bytes must be 0 or 1.
      continue;
    }
    if (tensor.sizes() != c10::IntArrayRef(info.shape) ||
        tensor.scalar_type() != fsdp::safetensors_scalar_type(info.dtype) ||
        static_cast<int64_t>(tensor.nbytes()) != info.end - info.begin) {
      std::abort();
    }
  }
  return 0;
}

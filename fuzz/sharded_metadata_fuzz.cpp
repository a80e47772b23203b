// Any bytes as the metadata.json of a legacy sharded directory (docs/checkpoint-format.md), beside
// two valid rank files written once per process: a ShardedDirectoryReader whose tensors are listed
// once each and whose rows read back with the listed shape and dtype, the same whole, in two pieces
// and as raw bytes, or a c10::Error; anything else (a crash, a sanitizer report, a hang, runaway
// memory) is a bug. The seeds in fuzz/corpus/sharded_metadata/ describe these rank files exactly.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/safetensors.h>
#include <fsdp/sharded_checkpoint.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dist/agreement.h"
#include "dist/control_channel.h"

// The writer half of sharded_checkpoint.cpp calls these; the reader never does. Defined here so
// that the target does not compile and link the process-group stack (src/dist/).
namespace fsdp {
const DistributedEnvironment& DistributedContext::environment() const { std::abort(); }
namespace detail {
void run_on_every_rank(const DistributedContext&, const std::function<void()>&) { std::abort(); }
std::string message_of(const std::exception&) { std::abort(); }
std::vector<std::string> all_gather_strings(const DistributedContext&, const std::string&) { std::abort(); }
}  // namespace detail
}  // namespace fsdp

namespace {

// A per-process directory holding rank files as write_sharded_directory writes them for two ranks:
// torch.chunk rows on dim 0, a replicated tensor and the 0-dim one on rank 0 only, "tail" empty on
// rank 1. (Which rows a file holds is written nowhere but in metadata.json, so the reader cannot tell
// swapped chunks of equal shape apart, and this target does not compare values with these tensors.)
std::string directory_name() { return "/tmp/fsdp_sharded_metadata_fuzz_" + std::to_string(::getpid()); }

const std::string& directory() {
  static const std::string path = [] {
    const std::string made = directory_name();
    std::filesystem::remove_all(made);
    std::filesystem::create_directories(made);
    // The exit handler runs after `path` is destroyed, so it builds the name again.
    std::atexit([] { std::filesystem::remove_all(directory_name()); });
    const auto embed = at::arange(66, at::kFloat).reshape({11, 6});
    const auto norm = at::linspace(0.5, 1.0, 6, at::kFloat);
    const auto mask = at::tensor(std::vector<uint8_t>{1, 0, 0, 1}).to(at::kBool);
    const auto tail = at::tensor(std::vector<float>{1.5f, -2.0f}).to(at::kBFloat16).reshape({1, 2});
    const auto step = at::scalar_tensor(42, at::kLong);
    fsdp::write_safetensors(made + "/rank_00000.safetensors",
                            {{"embed_tokens.weight", embed.narrow(0, 0, 6).contiguous()},
                             {"norm.weight", norm},
                             {"mask", mask.narrow(0, 0, 2).contiguous()},
                             {"tail", tail},
                             {"step", step}});
    fsdp::write_safetensors(made + "/rank_00001.safetensors",
                            {{"embed_tokens.weight", embed.narrow(0, 6, 5).contiguous()},
                             {"mask", mask.narrow(0, 2, 2).contiguous()},
                             {"tail", tail.narrow(0, 1, 0).contiguous()}});
    return made;
  }();
  return path;
}

void write_metadata(const uint8_t* data, size_t size) {
  const auto path = directory() + "/" + fsdp::kShardedMetadataFile;
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (!file) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, file) != size) std::abort();
  if (std::fclose(file) != 0) std::abort();
}

int64_t rows_of(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

// What a reader that opened promises: every listed tensor reads, whole or in pieces, as the files
// hold it. No c10::Error is acceptable past the constructor.
void check(const fsdp::ShardedDirectoryReader& reader) {
  const auto& names = reader.names();
  if (std::set<std::string>(names.begin(), names.end()).size() != names.size() || names.size() != reader.size()) {
    std::abort();
  }
  for (const auto& name : names) {
    if (!reader.contains(name)) std::abort();
    const auto shape = reader.shape(name);
    const auto dtype = fsdp::safetensors_scalar_type(reader.dtype(name));
    const auto whole = reader.rows(name, 0, rows_of(shape));
    if (whole.sizes() != c10::IntArrayRef(shape) || whole.scalar_type() != dtype) std::abort();
    if (shape.empty()) continue;
    const int64_t half = shape[0] / 2;
    const auto top = reader.rows(name, 0, half);
    const auto bottom = reader.rows(name, half, shape[0] - half);
    if (!at::equal(at::cat({top, bottom}), whole)) std::abort();
    std::vector<uint8_t> bytes(whole.nbytes());
    reader.read_rows(name, 0, shape[0], bytes.data());
    if (!bytes.empty() && std::memcmp(bytes.data(), whole.contiguous().data_ptr(), bytes.size()) != 0) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  write_metadata(data, size);
  std::optional<fsdp::ShardedDirectoryReader> reader;
  try {
    reader.emplace(directory());
  } catch (const c10::Error&) {
    return 0;
  }
  check(*reader);
  return 0;
}

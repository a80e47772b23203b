// Private to train_llama: the text it trains on and how each rank picks its sequences.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace train_llama {

/// The bytes of `path`, or, when `path` is empty, the built-in corpus: the license texts every
/// Debian system ships in /usr/share/common-licenses (base-files), or generated sentences when
/// those are absent. Throws naming the file when it cannot be read or is too short.
std::string load_corpus(const std::string& path, int64_t minimum_bytes);

/// Token ids (byte values) of `text`.
torch::Tensor bytes_to_tokens(const std::string& text);

/// The global batch of optimizer step `step`: `global_batch` windows of `length + 1` bytes at
/// offsets drawn from a generator seeded by (seed, step), identical on every rank and in a resumed
/// run. Returns [global_batch, length + 1] token ids.
torch::Tensor global_batch(const torch::Tensor& tokens, int64_t step, uint64_t seed, int64_t global_batch,
                           int64_t length);

}  // namespace train_llama

#include "train_llama/corpus.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

namespace train_llama {
namespace {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::error_code error;
  TORCH_CHECK(!fs::is_directory(path, error), "data file '", path,
              "' is a directory; --data and --eval-data take one text file (cat the files into one)");
  TORCH_CHECK(!fs::exists(path, error) || fs::is_regular_file(path, error), "data file '", path,
              "' is not a regular file; --data and --eval-data take a text file");
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "cannot read data file '", path, "': ", std::strerror(errno), "; check --data / --eval-data");
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

/// Deterministic English-like sentences for machines without the license texts.
std::string generated_corpus(int64_t bytes) {
  const std::vector<std::string> subjects = {"The model",     "A rank",     "Every shard",
                                             "The optimizer", "Each layer", "The loss"};
  const std::vector<std::string> verbs = {"gathers", "reduces", "updates", "keeps", "sends", "computes"};
  const std::vector<std::string> objects = {"its parameters",  "the gradients",  "one slice of the weights",
                                            "the full tensor", "a smaller loss", "the next batch"};
  std::mt19937 generator(7);
  std::string text;
  while (static_cast<int64_t>(text.size()) < bytes) {
    text += subjects[generator() % subjects.size()] + " " + verbs[generator() % verbs.size()] + " " +
            objects[generator() % objects.size()] + ". ";
  }
  return text;
}

}  // namespace

std::string load_corpus(const std::string& path, int64_t minimum_bytes) {
  std::string text;
  if (!path.empty()) {
    text = read_file(path);
  } else {
    const fs::path licenses = "/usr/share/common-licenses";
    std::vector<fs::path> files;
    if (fs::is_directory(licenses)) {
      for (const auto& item : fs::directory_iterator(licenses)) {
        // Symlinks (GPL -> GPL-3) would repeat texts.
        if (item.is_regular_file() && !item.is_symlink()) files.push_back(item.path());
      }
    }
    std::sort(files.begin(), files.end());
    for (const auto& file : files) text += read_file(file.string());
    if (static_cast<int64_t>(text.size()) < minimum_bytes)
      text = generated_corpus(std::max<int64_t>(minimum_bytes, 200000));
  }
  TORCH_CHECK(static_cast<int64_t>(text.size()) >= minimum_bytes, "data file '",
              path.empty() ? "(built-in corpus)" : path, "' has ", text.size(), " bytes; at least ", minimum_bytes,
              " are needed (sequence length + 1). Use a longer text or --seq-len");
  return text;
}

torch::Tensor bytes_to_tokens(const std::string& text) {
  auto tokens = torch::empty({static_cast<int64_t>(text.size())}, torch::kLong);
  auto accessor = tokens.accessor<int64_t, 1>();
  for (size_t index = 0; index < text.size(); ++index) accessor[index] = static_cast<unsigned char>(text[index]);
  return tokens;
}

torch::Tensor global_batch(const torch::Tensor& tokens, int64_t step, uint64_t seed, int64_t batch, int64_t length) {
  std::mt19937_64 generator(seed * 1000003ULL + static_cast<uint64_t>(step));
  const int64_t positions = tokens.size(0) - length;
  std::vector<torch::Tensor> windows;
  for (int64_t index = 0; index < batch; ++index) {
    const int64_t offset = static_cast<int64_t>(generator() % static_cast<uint64_t>(positions));
    windows.push_back(tokens.narrow(0, offset, length + 1));
  }
  return torch::stack(windows);
}

}  // namespace train_llama

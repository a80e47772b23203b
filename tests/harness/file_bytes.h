// A file's whole contents as bytes, for the tests that compare what programs wrote ("" when it
// cannot be read, which the comparison then shows).
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fsdp::testing {

inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

}  // namespace fsdp::testing

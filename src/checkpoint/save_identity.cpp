#include "checkpoint/save_identity.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/collectives.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "io/read_only_file.h"

namespace fsdp::detail {
namespace {

constexpr char kMagic[] = "fsdp.id1";
constexpr int64_t kMagicBytes = 8;
constexpr int64_t kLengthBytes = 8;
// An identity is under 200 bytes; anything longer is not one of ours.
constexpr int64_t kMaxIdentityBytes = 4096;

}  // namespace

std::string new_save_id() {
  std::random_device device;
  std::mt19937_64 generator((static_cast<uint64_t>(device()) << 32) ^ device());
  char text[40];
  const uint64_t high = generator();
  const uint64_t low = generator();
  std::snprintf(text, sizeof(text), "%08llx-%04llx-%04llx-%04llx-%012llx", static_cast<unsigned long long>(high >> 32),
                static_cast<unsigned long long>((high >> 16) & 0xffff), static_cast<unsigned long long>(high & 0xffff),
                static_cast<unsigned long long>(low >> 48), static_cast<unsigned long long>(low & 0xffffffffffffULL));
  return text;
}

std::string share_save_id(const DistributedContext& context) {
  auto bytes = at::zeros({kSaveIdLength}, at::kByte);
  if (context.rank() == 0) {
    const auto id = new_save_id();
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(id.size()) == kSaveIdLength, "save id '", id, "'");
    std::memcpy(bytes.data_ptr(), id.data(), id.size());
  }
  broadcast(context.control(), bytes, 0);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(kSaveIdLength));
}

std::string identity_footer(const FileIdentity& identity) {
  const std::string json =
      nlohmann::json{{"save_id", identity.save_id}, {"rank", identity.rank}, {"world_size", identity.world_size}}
          .dump();
  std::string footer = json;
  uint64_t length = json.size();
  for (int byte = 0; byte < kLengthBytes; ++byte) footer.push_back(static_cast<char>((length >> (8 * byte)) & 0xff));
  footer.append(kMagic, kMagicBytes);
  return footer;
}

std::optional<FoundIdentity> read_identity_footer(const ReadOnlyFile& file) {
  const auto size = static_cast<int64_t>(file.size());
  const auto& path = file.path();
  if (size < kMagicBytes + kLengthBytes) return std::nullopt;
  unsigned char tail[kMagicBytes + kLengthBytes];
  file.read_exactly(tail, sizeof(tail), static_cast<uint64_t>(size) - sizeof(tail), "the save identity footer");
  if (std::memcmp(tail + kLengthBytes, kMagic, kMagicBytes) != 0) return std::nullopt;
  uint64_t length = 0;
  for (int byte = 0; byte < kLengthBytes; ++byte) length |= static_cast<uint64_t>(tail[byte]) << (8 * byte);
  const std::string damaged = "'" + path + "' ends with fsdp.cpp's save identity footer, but it is damaged: ";
  TORCH_CHECK(length > 0 && length <= static_cast<uint64_t>(kMaxIdentityBytes) &&
                  static_cast<int64_t>(length) <= size - kMagicBytes - kLengthBytes,
              damaged, "it gives a length of ", length, " bytes. Restore the file, or load an earlier checkpoint");
  std::string json(length, '\0');
  file.read_exactly(json.data(), length, static_cast<uint64_t>(size - kMagicBytes - kLengthBytes) - length,
                    "the save identity footer");
  FoundIdentity found;
  found.footer_bytes = kMagicBytes + kLengthBytes + static_cast<int64_t>(length);
  nlohmann::json value = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(value.is_object() && value.contains("save_id") && value["save_id"].is_string() &&
                  value.contains("rank") && value["rank"].is_number_integer() && value.contains("world_size") &&
                  value["world_size"].is_number_integer(),
              damaged, "expected JSON with save_id (a string), rank and world_size (integers), found '", json,
              "'. Restore the file, or load an earlier checkpoint");
  found.identity.save_id = value["save_id"].get<std::string>();
  found.identity.rank = value["rank"].get<int64_t>();
  found.identity.world_size = value["world_size"].get<int64_t>();
  TORCH_CHECK(found.identity.rank >= 0 && found.identity.world_size > found.identity.rank, damaged, "rank ",
              found.identity.rank, " of world size ", found.identity.world_size,
              ". Restore the file, or load an earlier checkpoint");
  return found;
}

}  // namespace fsdp::detail

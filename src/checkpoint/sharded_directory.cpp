#include "checkpoint/sharded_directory.h"

#include <c10/util/Exception.h>
#include <fsdp/sharded_checkpoint.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_reader.h"

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

// A format's reader behind the interface; the readers themselves know nothing of it.
template <typename Reader>
class ReaderDirectory : public ShardedDirectory {
 public:
  explicit ReaderDirectory(const std::string& directory) : reader_(directory) {}
  bool contains(const std::string& name) const override { return reader_.contains(name); }
  std::vector<int64_t> shape(const std::string& name) const override { return reader_.shape(name); }
  at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const override {
    return reader_.rows(name, row_begin, row_count);
  }
  size_t size() const override { return reader_.size(); }
  std::string description() const override { return reader_.description(); }
  const std::vector<std::string>& names() const override { return reader_.names(); }
  std::string dtype(const std::string& name) const override { return reader_.dtype(name); }
  void read_rows(const std::string& name, int64_t row_begin, int64_t row_count, void* destination) const override {
    reader_.read_rows(name, row_begin, row_count, destination);
  }

 protected:
  Reader reader_;
};

// The rank-file format: an optimizer's type and groups are in its metadata's "extra" object.
class RankFileDirectory : public ReaderDirectory<ShardedDirectoryReader> {
 public:
  using ReaderDirectory::ReaderDirectory;
  std::optional<OptimizerGroups> optimizer_groups(
      const std::string& /*expected_type: recorded by name*/) const override {
    const auto extra = nlohmann::json::parse(reader_.extra_json());
    if (!extra.contains("optimizer") || !extra.contains("param_groups")) return std::nullopt;
    TORCH_CHECK(extra["optimizer"].is_string(), reader_.description(), ": the optimizer's type in its metadata is ",
                extra["optimizer"].dump(), ", not a name");
    return OptimizerGroups{extra["optimizer"].get<std::string>(), extra["param_groups"].dump()};
  }
  std::optional<std::string> save_id() const override { return std::nullopt; }
  int64_t entry_count() const override { return static_cast<int64_t>(reader_.size()); }
};

// DCP: an optimizer's directory holds its parameter groups as byte items; a model's holds none.
class DcpDirectory : public ReaderDirectory<DcpDirectoryReader> {
 public:
  using ReaderDirectory::ReaderDirectory;
  std::optional<OptimizerGroups> optimizer_groups(const std::string& expected_type) const override {
    if (reader_.byte_item_keys().empty()) return std::nullopt;
    const auto groups = dcp_param_groups(reader_, expected_type);
    return OptimizerGroups{groups.optimizer, groups.json};
  }
  std::optional<std::string> save_id() const override { return reader_.save_id(); }
  int64_t entry_count() const override { return static_cast<int64_t>(reader_.metadata().keys.size()); }
  bool copy_rows(const std::string& name, int64_t row_begin, int64_t row_count,
                 const FileRangeWriter& copy) const override {
    return reader_.copy_rows(name, row_begin, row_count, copy);
  }
};

}  // namespace

ShardedFormat sharded_directory_format(const std::string& directory) {
  std::error_code error;
  const bool dcp = is_dcp_directory(directory);
  const bool rank_files = fs::exists(fs::path(directory) / kShardedMetadataFile, error);
  TORCH_CHECK(!(dcp && rank_files), "'", directory, "' holds both a DCP .metadata and ", kShardedMetadataFile,
              " (the rank-file format): two saves were written into it, and either could be read. Keep the files "
              "of one save, or load an earlier checkpoint");
  return dcp ? ShardedFormat::kDcp : rank_files ? ShardedFormat::kRankFiles : ShardedFormat::kNone;
}

std::unique_ptr<ShardedDirectory> open_sharded_directory(const std::string& directory) {
  if (sharded_directory_format(directory) == ShardedFormat::kDcp) return std::make_unique<DcpDirectory>(directory);
  return std::make_unique<RankFileDirectory>(directory);
}

}  // namespace fsdp::detail

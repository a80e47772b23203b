// Note [sharded directories]: the one probe that decides a directory's format.
#include "checkpoint/sharded_directory.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "harness/error_message.h"

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

TEST(ShardedDirectory, TheProbeNamesTheFormatByItsMetadataFileAndRefusesBoth) {
  const auto directory = fs::temp_directory_path() / ("fsdp_sharded_directory_" + std::to_string(::getpid()));
  fs::create_directories(directory);
  EXPECT_EQ(sharded_directory_format(directory.string()), ShardedFormat::kNone);
  std::ofstream(directory / ".metadata") << "x";
  EXPECT_EQ(sharded_directory_format(directory.string()), ShardedFormat::kDcp);
  std::ofstream(directory / "metadata.json") << "{}";
  const auto message = testing::error_message_of([&] { sharded_directory_format(directory.string()); });
  EXPECT_NE(message.find("holds both a DCP .metadata and metadata.json (the rank-file format): two saves"),
            std::string::npos)
      << message;
  fs::remove(directory / ".metadata");
  EXPECT_EQ(sharded_directory_format(directory.string()), ShardedFormat::kRankFiles);
  fs::remove_all(directory);
}

}  // namespace
}  // namespace fsdp::detail

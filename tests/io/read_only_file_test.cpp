// Note [reading untrusted files]: one test per policy of the one type every reader opens files with,
// and one through a public reader, to show the policy reaches it.
#include "io/read_only_file.h"

#include <fcntl.h>
#include <fsdp/safetensors.h>
#include <fsdp/torch_file.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "harness/error_message.h"

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

class ReadOnlyFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = fs::temp_directory_path() / ("fsdp_read_only_file_" + std::to_string(::getpid()));
    fs::create_directories(directory_);
  }
  void TearDown() override { fs::remove_all(directory_); }
  std::string path(const std::string& name) const { return (directory_ / name).string(); }
  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream(path(name), std::ios::binary) << bytes;
    return path(name);
  }
  fs::path directory_;
};

TEST_F(ReadOnlyFileTest, ReadsARegularFileWholeAtAnOffsetAndMapped) {
  const auto file_path = write("data.bin", "0123456789");
  ReadOnlyFile file(file_path, 10, "test file");
  EXPECT_EQ(file.size(), 10u);
  EXPECT_EQ(file.read_text(), "0123456789");
  char middle[3];
  file.read_exactly(middle, 3, 4, "the middle");
  EXPECT_EQ(std::string(middle, 3), "456");
  char tail[8];
  EXPECT_EQ(file.read_at_most(tail, sizeof(tail), 6), 4u);  // short only where the file ends
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.map()), 10), "0123456789");
  ReadOnlyFile moved = std::move(file);  // the mapping and descriptor go with it, released once
  EXPECT_EQ(moved.read_all().size(), 10u);
  EXPECT_EQ(ReadOnlyFile(write("empty", ""), 0, "test file").map(), nullptr);
}

TEST_F(ReadOnlyFileTest, AFifoIsRefusedWithoutWaitingForAWriter) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  const auto message = testing::error_message_of([&] { ReadOnlyFile(path("fifo"), 100, "test file", "give a file"); });
  EXPECT_NE(message.find("test file '" + path("fifo") + "' is not a regular file (it is a FIFO); give a file"),
            std::string::npos)
      << message;
}

TEST_F(ReadOnlyFileTest, ADirectoryIsRefused) {
  const auto message = testing::error_message_of([&] { ReadOnlyFile(directory_.string(), 100, "test file"); });
  EXPECT_NE(message.find("is not a regular file (it is a directory)"), std::string::npos) << message;
}

TEST_F(ReadOnlyFileTest, ALoopOfSymbolicLinksIsNamedAndALinkToAFileIsFollowed) {
  fs::create_symlink(path("b"), path("a"));
  fs::create_symlink(path("a"), path("b"));
  const auto message = testing::error_message_of([&] { ReadOnlyFile(path("a"), 100, "test file"); });
  EXPECT_NE(message.find("test file '" + path("a") + "' is a loop of symbolic links"), std::string::npos) << message;
  fs::create_symlink(write("target", "bytes"), path("link"));
  EXPECT_EQ(ReadOnlyFile(path("link"), 100, "test file").read_text(), "bytes");
}

TEST_F(ReadOnlyFileTest, AFileOverTheCallersBoundIsRefusedBeforeItIsRead) {
  const auto file_path = write("large", std::string(101, 'x'));
  const auto message =
      testing::error_message_of([&] { ReadOnlyFile(file_path, 100, "test file", "give a smaller one"); });
  EXPECT_NE(
      message.find("has 101 bytes, more than the 100 a test file can have: it is refused before anything is read; "
                   "give a smaller one"),
      std::string::npos)
      << message;
  EXPECT_EQ(ReadOnlyFile(file_path, 101, "test file").size(), 101u);
}

TEST_F(ReadOnlyFileTest, AFileTruncatedWhileBeingReadIsAnErrorNotShortData) {
  const auto file_path = write("shrinks", std::string(64, 'x'));
  ReadOnlyFile file(file_path, 64, "test file");
  fs::resize_file(file_path, 16);  // another process truncates it after it was opened
  auto message = testing::error_message_of([&] { file.read_all(); });
  EXPECT_NE(message.find("the file ended after 16 of 64 bytes at byte 0 of test file"), std::string::npos) << message;
  EXPECT_NE(message.find("truncated while being read"), std::string::npos) << message;
}

TEST_F(ReadOnlyFileTest, CopiesExactlyTheRangeInTheKernelOrThroughABufferAndATruncatedSourceIsNamed) {
  std::string bytes(3 << 20, '\0');
  for (size_t index = 0; index < bytes.size(); ++index) bytes[index] = static_cast<char>(index * 131 % 251);
  ReadOnlyFile source(write("source", bytes), bytes.size(), "test file");
  // Into a regular file (copy_file_range), after bytes written the ordinary way: appended at its position.
  const auto target_path = path("target");
  int target = ::open(target_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(target, 0);
  ASSERT_EQ(::write(target, "head", 4), 4);
  source.copy_exactly_to(target, 1000, (2 << 20) + 7, "the range");
  source.copy_exactly_to(target, 0, 0, "nothing");
  ::close(target);
  std::ifstream copied(target_path, std::ios::binary);
  const std::string found((std::istreambuf_iterator<char>(copied)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(found == "head" + bytes.substr(1000, (2 << 20) + 7)) << "copied " << found.size() << " bytes";
  // Into a pipe, which copy_file_range refuses: through the buffer instead.
  int pipe_ends[2];
  ASSERT_EQ(::pipe(pipe_ends), 0);
  source.copy_exactly_to(pipe_ends[1], 5, 4000, "the range");
  std::string piped(4000, '\0');
  ASSERT_EQ(::read(pipe_ends[0], piped.data(), piped.size()), 4000);
  ::close(pipe_ends[0]);
  ::close(pipe_ends[1]);
  EXPECT_TRUE(piped == bytes.substr(5, 4000));
  // A source cut short after it was opened: named, not short output.
  fs::resize_file(path("source"), 100);
  target = ::open(target_path.c_str(), O_WRONLY | O_TRUNC);
  auto message = testing::error_message_of([&] { source.copy_exactly_to(target, 50, 200, "chunk of 'w'"); });
  ::close(target);
  EXPECT_NE(message.find("chunk of 'w': the file ended after 50 of 200 bytes at byte 50 of test file"),
            std::string::npos)
      << message;
}

TEST_F(ReadOnlyFileTest, AMissingFileIsNamedOrNothingWhereTheCallerAsks) {
  EXPECT_FALSE(ReadOnlyFile::open_if_exists(path("missing"), 100, "test file").has_value());
  EXPECT_TRUE(ReadOnlyFile::open_if_exists(write("there", "x"), 100, "test file").has_value());
  const auto message = testing::error_message_of([&] { ReadOnlyFile(path("missing"), 100, "test file"); });
  EXPECT_NE(
      message.find("cannot open test file '" + path("missing") + "': it cannot be read (No such file or directory)"),
      std::string::npos)
      << message;
}

// The readers apply the policy: a safetensors file truncated after it was opened, and a FIFO in
// place of a torch file.
TEST_F(ReadOnlyFileTest, TheReadersApplyIt) {
  const auto file_path = path("model.safetensors");
  write_safetensors(file_path, {{"weight", at::ones({64, 4})}});
  SafetensorsReader reader(file_path);
  fs::resize_file(file_path, fs::file_size(file_path) - 512);
  auto message = testing::error_message_of([&] { reader.tensor("weight"); });
  EXPECT_NE(message.find("tensor 'weight' rows [0, 64): the file ended after"), std::string::npos) << message;
  ASSERT_EQ(::mkfifo(path("model.bin").c_str(), 0600), 0);
  message = testing::error_message_of([&] { load_torch_file(path("model.bin")); });
  EXPECT_NE(message.find("torch file '" + path("model.bin") + "' is not a regular file (it is a FIFO)"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace fsdp::detail

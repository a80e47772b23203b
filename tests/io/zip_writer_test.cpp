// The torch.save archives our zip writer produces (src/io/zip_writer.h), read by the real readers:
// Python's zipfile verifies every record's CRC-32 (testzip), torch.load reads the tensors, and
// libtorch's own reader (our load_torch_file) reads them back; also with every field in its ZIP64
// form, the path records of 4 GiB and more take, and (zipfile only: miniz checks a 32-bit offset
// against the archive's size) with the mixed forms of an archive past 4 GiB.
#include "io/zip_writer.h"

#include <caffe2/serialize/inline_container.h>
#include <fsdp/state_dict.h>
#include <fsdp/torch_file.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "harness/python_peer.h"
#include "io/atomic_file.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

class ZipWriterSideBySide : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = fs::temp_directory_path() / ("fsdp_zip_writer_" + std::to_string(::getpid()));
    fs::remove_all(directory_);
    fs::create_directories(directory_);
  }
  void TearDown() override { fs::remove_all(directory_); }
  fs::path directory_;
};

// What the Python side compares against: bit patterns that any misplaced byte would change.
TensorList sample_tensors() {
  return {{"a", torch::arange(100000, torch::kFloat).mul(0.37)},
          {"b", torch::arange(15, torch::kDouble).reshape({3, 5})},
          {"empty", torch::zeros({0, 4})},
          {"scalar", torch::tensor(2.5f)}};
}

TEST_F(ZipWriterSideBySide, PythonVerifiesEveryChecksumAndTorchLoadReadsTheTensors) {
  const auto plain = (directory_ / "plain.pt").string();
  save_torch_file(plain, tensor_dict(sample_tensors()));
  // The same records again, every size and offset in its ZIP64 form; and with the ZIP64 threshold
  // at 1000 bytes, the mixed forms of an archive past 4 GiB: small records with 32-bit fields, a
  // large one with a ZIP64 size, small ones after it with only a ZIP64 offset.
  auto rewrite = [&](const std::string& path, uint64_t zip64_from) {
    caffe2::serialize::PyTorchStreamReader reader(plain);
    detail::write_file_atomically(path, [&](const detail::ByteSink& sink) {
      detail::ZipWriter writer(sink, zip64_from);
      for (const auto& name : reader.getAllRecords()) {
        if (name == "version" || name == "byteorder" || name == ".data/serialization_id") continue;  // finish()'s
        auto [data, size] = reader.getRecord(name);
        writer.write_record(name, data.get(), size);
      }
      writer.finish();
    });
  };
  const auto zip64 = (directory_ / "zip64.pt").string();
  rewrite(zip64, 0);
  const auto mixed = (directory_ / "mixed.pt").string();
  rewrite(mixed, 1000);
  for (const auto& path : {plain, zip64}) {
    const auto loaded = tensor_dict_items(load_torch_file(path), path);
    const auto expected = sample_tensors();
    ASSERT_EQ(loaded.size(), expected.size()) << path;
    for (size_t index = 0; index < expected.size(); ++index) {
      EXPECT_EQ(loaded[index].first, expected[index].first) << path;
      EXPECT_TRUE(torch::equal(loaded[index].second, expected[index].second)) << path << " " << expected[index].first;
    }
  }
  const auto python = testing::run_python_code(
      "import sys, zipfile, torch\n"
      "for path in ['" +
      plain + "', '" + zip64 +
      "']:\n"
      "    with zipfile.ZipFile(path) as archive:\n"
      "        bad = archive.testzip()\n"
      "        assert bad is None, f'{path}: record {bad} fails its CRC-32'\n"
      "        names = archive.namelist()\n"
      "        assert all(n.startswith('archive/') for n in names), names\n"
      "        for info in archive.infolist():\n"
      "            assert info.compress_type == zipfile.ZIP_STORED, info\n"
      "    state = torch.load(path, weights_only=True)\n"
      "    assert list(state) == ['a', 'b', 'empty', 'scalar'], list(state)\n"
      "    assert torch.equal(state['a'], torch.arange(100000, dtype=torch.float32).mul(0.37)), path\n"
      "    assert torch.equal(state['b'], torch.arange(15, dtype=torch.float64).reshape(3, 5)), path\n"
      "    assert state['empty'].shape == (0, 4) and state['scalar'].item() == 2.5, path\n"
      "with zipfile.ZipFile('" +
      mixed + "') as archive, zipfile.ZipFile('" + plain +
      "') as reference:\n"
      "    assert archive.testzip() is None\n"
      "    assert archive.namelist() == reference.namelist(), archive.namelist()\n"
      "    for name in reference.namelist():\n"
      "        assert archive.read(name) == reference.read(name), name\n"
      "print('ok')\n");
  ASSERT_TRUE(python.ok);
  EXPECT_NE(python.output.at(0).find("ok"), std::string::npos) << python.output.at(0);
}

TEST_F(ZipWriterSideBySide, EachRecordsDataStartsOnA64ByteBoundaryAsLibtorchsDoes) {
  // DCP's reader and ours read a tensor's bytes in place at its record's offset; libtorch aligns
  // them to 64 bytes and so do we.
  const auto path = (directory_ / "aligned.pt").string();
  save_torch_file(path, tensor_dict(sample_tensors()));
  caffe2::serialize::PyTorchStreamReader reader(path);
  for (const auto& name : reader.getAllRecords()) {
    EXPECT_EQ(reader.getRecordOffset(name) % 64, 0u) << name;
  }
  EXPECT_TRUE(reader.hasRecord("version"));
  EXPECT_TRUE(reader.hasRecord("byteorder"));
  EXPECT_EQ(reader.getRecordSize(".data/serialization_id"), 40u);
}

}  // namespace
}  // namespace fsdp

#include <caffe2/serialize/inline_container.h>
#include <fsdp/torch_file.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "harness/error_message.h"

namespace fsdp {
namespace {

class TorchFile : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() / ("fsdp_torch_file_" + std::to_string(::getpid()));
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }
  std::string path(const std::string& name) const { return (directory_ / name).string(); }
  std::filesystem::path directory_;
};

TEST_F(TorchFile, RoundTripsADictOfTensors) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors = {
      {"layer.weight", torch::randn({3, 4})}, {"layer.bias", torch::arange(3)}, {"flag", torch::tensor(true)}};
  save_torch_file(path("model.bin"), tensor_dict(tensors));
  auto loaded = tensor_dict_items(load_torch_file(path("model.bin")), "model.bin");
  ASSERT_EQ(loaded.size(), tensors.size());
  for (size_t index = 0; index < tensors.size(); ++index) {
    EXPECT_EQ(loaded[index].first, tensors[index].first);
    EXPECT_TRUE(torch::equal(loaded[index].second, tensors[index].second));
  }
  auto message = testing::error_message_of([&] { load_torch_file(path("missing.bin")); });
  EXPECT_NE(message.find("cannot open torch file"), std::string::npos) << message;
}

// A pickle written opcode by opcode (protocol 2, as torch.save writes), for the hostile files below.
struct Pickle {
  std::string bytes = "\x80\x02";
  Pickle& op(char code) {
    bytes += code;
    return *this;
  }
  Pickle& global(const std::string& module, const std::string& name) {
    bytes += 'c' + module + '\n' + name + '\n';
    return *this;
  }
  Pickle& text(const std::string& value) {
    const uint32_t size = static_cast<uint32_t>(value.size());
    bytes += 'X';
    bytes.append(reinterpret_cast<const char*>(&size), 4);  // little-endian, as pickle's BINUNICODE
    bytes += value;
    return *this;
  }
  Pickle& small(uint8_t value) {
    bytes += 'K';
    bytes += static_cast<char>(value);
    return *this;
  }
  Pickle& floating(double value) {  // BINFLOAT: big-endian
    uint64_t word;
    std::memcpy(&word, &value, 8);
    bytes += 'G';
    for (int shift = 56; shift >= 0; shift -= 8) bytes += static_cast<char>((word >> shift) & 0xff);
    return *this;
  }
  Pickle& ordered_dict() { return global("collections", "OrderedDict").op(')').op('R'); }
  // _rebuild_tensor_v2(persistent_load(('storage', torch.FloatStorage, key, 'cpu', elements)), 0,
  //                    (size,), (1,), False, OrderedDict())
  Pickle& float_tensor(const std::string& key, uint8_t elements, uint8_t size) {
    global("torch._utils", "_rebuild_tensor_v2").op('(');
    op('(').text("storage").global("torch", "FloatStorage").text(key).text("cpu").small(elements).op('t').op('Q');
    small(0).small(size).op('\x85').small(1).op('\x85').op('\x89').ordered_dict();
    return op('t').op('R');
  }
  // _rebuild_tensor_v3(persistent_load(('storage', torch.storage.UntypedStorage, key, 'cpu', bytes)),
  //                    0, (size,), (1,), False, OrderedDict(), torch.float32): how torch.save writes
  // the dtypes without a typed storage. libtorch's unpickler does not know it, so every such file
  // is read by the restricted path alone.
  Pickle& float_tensor_v3(const std::string& key, uint8_t bytes, uint8_t size) {
    global("torch._utils", "_rebuild_tensor_v3").op('(');
    op('(')
        .text("storage")
        .global("torch.storage", "UntypedStorage")
        .text(key)
        .text("cpu")
        .small(bytes)
        .op('t')
        .op('Q');
    small(0).small(size).op('\x85').small(1).op('\x85').op('\x89').ordered_dict().global("torch", "float32");
    return op('t').op('R');
  }
};

// Writes a torch.save zip holding `pickle` as data.pkl and `storage` as data/0.
void write_torch_zip(const std::string& path, const Pickle& pickle, const std::string& storage) {
  std::string zip;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
      zip.append(static_cast<const char*>(data), size);
      return size;
    });
    writer.writeRecord("data.pkl", pickle.bytes.data(), pickle.bytes.size());
    writer.writeRecord("data/0", storage.data(), storage.size());
    writer.writeEndOfFile();
  }
  std::ofstream(path, std::ios::binary) << zip;
}

// Files libtorch's unpickler gives up on (an OrderedDict at the root) go through the restricted
// path (Note [torch files through the restricted unpickler]); each hostile one is a named error.
TEST_F(TorchFile, HostileOrderedDictFilesAreNamedErrors) {
  const std::string four_floats(16, '\0');
  auto dict_of = [](const std::function<void(Pickle&)>& items) {
    Pickle pickle;
    pickle.ordered_dict().op('(');
    items(pickle);
    pickle.op('u').op('.');
    return pickle;
  };
  // The well-formed file the others break, read: the builder above writes what the reader takes.
  for (const bool v3 : {false, true}) {
    write_torch_zip(path("good.bin"), dict_of([&](Pickle& p) {
                      v3 ? p.text("w").float_tensor_v3("0", 16, 4) : p.text("w").float_tensor("0", 4, 4);
                    }),
                    four_floats);
    const auto good = tensor_dict_items(load_torch_file(path("good.bin")), "good.bin");
    ASSERT_EQ(good.size(), 1u);
    EXPECT_EQ(good[0].first, "w");
    EXPECT_TRUE(torch::equal(good[0].second, torch::zeros({4})));
  }

  auto error_of = [&](const std::string& name, const Pickle& pickle, const std::string& storage) {
    write_torch_zip(path(name), pickle, storage);
    return testing::error_message_of([&] { load_torch_file(path(name)); });
  };
  // A storage record shorter than its reference says.
  auto message =
      error_of("short.bin", dict_of([](Pickle& p) { p.text("w").float_tensor_v3("0", 16, 4); }), std::string(12, '\0'));
  EXPECT_NE(message.find("has a storage record 'data/0' of 12 bytes where its reference says 16"), std::string::npos)
      << message;
  // A view reaching past its storage.
  message = error_of("past.bin", dict_of([](Pickle& p) { p.text("w").float_tensor_v3("0", 16, 5); }), four_floats);
  EXPECT_NE(message.find("that reaches past its 16-byte storage '0'"), std::string::npos) << message;
  // One storage referred to with two lengths.
  message = error_of("two_lengths.bin", dict_of([](Pickle& p) {
                       p.text("a").float_tensor_v3("0", 16, 4).text("b").float_tensor_v3("0", 12, 3);
                     }),
                     four_floats);
  EXPECT_NE(message.find("refers to storage '0' as 12 bytes and elsewhere as 16"), std::string::npos) << message;
  // A key that is neither a string nor an integer.
  message = error_of("float_key.bin", dict_of([](Pickle& p) { p.floating(1.5).float_tensor("0", 4, 4); }), four_floats);
  EXPECT_NE(message.find("keys are neither all strings nor all integers"), std::string::npos) << message;
  // A dict that contains itself: OrderedDict() memoized (BINPUT 0), then {"self": <memo 0>}.
  Pickle cycle;
  cycle.ordered_dict().op('q').op('\0').op('(').text("self").op('h').op('\0').op('u').op('.');
  message = error_of("cycle.bin", cycle, four_floats);
  EXPECT_NE(message.find("contains itself (a cycle)"), std::string::npos) << message;
  // A storage class outside the allow-list is refused by name before anything is built.
  Pickle foreign;
  foreign.ordered_dict().op('(').text("w").global("torch._utils", "_rebuild_tensor_v2").op('(');
  foreign.op('(').text("storage").global("os", "system").text("0").text("cpu").small(4).op('t').op('Q');
  foreign.small(0).small(4).op('\x85').small(1).op('\x85').op('\x89').ordered_dict().op('t').op('R').op('u').op('.');
  message = error_of("foreign.bin", foreign, four_floats);
  EXPECT_NE(message.find("os.system"), std::string::npos) << message;
  for (const auto& name : {"short.bin", "past.bin", "two_lengths.bin", "float_key.bin", "cycle.bin", "foreign.bin"}) {
    EXPECT_TRUE(std::filesystem::exists(path(name))) << "a failed read never deletes its input: " << name;
  }
}

}  // namespace
}  // namespace fsdp

// The restricted unpickler (src/io/restricted_unpickler.h) on pickles Python wrote (the byte strings
// below are Python 3.11's pickle.dumps of the values in the comments) and on hostile ones: a global
// outside the allow-list, truncation, unknown opcodes, memo misuse, deep nesting.
#include "io/restricted_unpickler.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness/error_message.h"

namespace fsdp::detail {
namespace {

using Kind = PickleValue::Kind;

std::vector<uint8_t> from_hex(const std::string& hex) {
  std::vector<uint8_t> bytes;
  for (size_t index = 0; index + 1 < hex.size(); index += 2)
    bytes.push_back(static_cast<uint8_t>(std::stoi(hex.substr(index, 2), nullptr, 16)));
  return bytes;
}

std::string error_of(const std::vector<uint8_t>& bytes, const std::set<std::string>& allowed = {}) {
  return testing::error_message_of([&] { restricted_unpickle(bytes.data(), bytes.size(), allowed, "test.pkl"); });
}

TEST(RestrictedUnpickler, ReadsThePlainValuesPythonWrites) {
  // pickle.dumps({'a': [1, 2.5, 'x', True, None, (3,), -300, 2**40, b'\x00\x01']}, protocol=4)
  const auto bytes = from_hex(
      "80049533000000000000007d948c0161945d94284b014740040000000000008c017894884e4b0385944ad4feffff8a060000000000014302"
      "00"
      "019465732e");
  const auto document = restricted_unpickle(bytes.data(), bytes.size(), {}, "test.pkl");
  ASSERT_EQ(document.root->kind, Kind::kDict);
  const auto* list = document.root->find("a");
  ASSERT_TRUE(list);
  ASSERT_EQ(list->kind, Kind::kList);
  ASSERT_EQ(list->items.size(), 9u);
  EXPECT_EQ(list->items[0]->integer, 1);
  EXPECT_EQ(list->items[1]->floating, 2.5);
  EXPECT_EQ(list->items[2]->text, "x");
  EXPECT_TRUE(list->items[3]->boolean);
  EXPECT_EQ(list->items[4]->kind, Kind::kNone);
  ASSERT_EQ(list->items[5]->kind, Kind::kTuple);
  EXPECT_EQ(list->items[5]->items[0]->integer, 3);
  EXPECT_EQ(list->items[6]->integer, -300);
  EXPECT_EQ(list->items[7]->integer, int64_t{1} << 40);
  EXPECT_EQ(list->items[8]->kind, Kind::kBytes);
  EXPECT_EQ(list->items[8]->text, std::string("\x00\x01", 2));
}

TEST(RestrictedUnpickler, SharedValuesThroughTheMemoAreOneValue) {
  // pickle.dumps([[1, 2], [1, 2]], protocol=2): two distinct lists, then one list referenced twice.
  const auto bytes = from_hex("80025d7100285d7101284b014b02655d7102284b014b0265652e");
  const auto document = restricted_unpickle(bytes.data(), bytes.size(), {}, "test.pkl");
  ASSERT_EQ(document.root->items.size(), 2u);
  EXPECT_EQ(document.root->items[0]->items.size(), 2u);
  // A list that contains itself (BINGET of the list, APPEND) is read without looping.
  const auto cyclic = from_hex("80025d71006800616800612e");
  const auto cycle = restricted_unpickle(cyclic.data(), cyclic.size(), {}, "test.pkl");
  EXPECT_EQ(cycle.root->items.size(), 2u);  // the list, twice
  EXPECT_EQ(cycle.root->items[0], cycle.root);
}

TEST(RestrictedUnpickler, AGlobalOutsideTheAllowListIsRefusedByName) {
  // pickle.dumps(os.system, protocol=4)
  const auto bytes = from_hex("80049514000000000000008c05706f736978948c0673797374656d9493942e");
  const auto message = error_of(bytes, {"torch.Size"});
  EXPECT_NE(message.find("'test.pkl': pickle byte 28: references 'posix.system', which this file type does not hold"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("loading never executes code"), std::string::npos) << message;
  // The same with the text GLOBAL opcode, and a REDUCE of it.
  const std::string text =
      "\x80\x02"
      "cos\nsystem\n"
      "X\x02\x00\x00\x00ls"
      "\x85R.";
  const auto message2 = error_of(std::vector<uint8_t>(text.begin(), text.end()));
  EXPECT_NE(message2.find("references 'os.system'"), std::string::npos) << message2;
}

TEST(RestrictedUnpickler, AllowedCallsBecomeObjectsWithoutRunningAnything) {
  // REDUCE(torch.Size, ((2, 3),)) then BUILD on a NEWOBJ'd allowed class.
  const std::string text =
      "\x80\x04"
      "\x8c\x05torch\x8c\x04Size\x93"
      "K\x02K\x03\x86\x85R"
      "\x8c\x01m\x8c\x01"
      "C\x93)\x81}\x8c\x01"
      "f\x88sb\x86.";
  const std::vector<uint8_t> bytes(text.begin(), text.end());
  const auto document = restricted_unpickle(bytes.data(), bytes.size(), {"torch.Size", "m.C"}, "test.pkl");
  ASSERT_EQ(document.root->kind, Kind::kTuple);
  const auto* size = document.root->items[0];
  ASSERT_EQ(size->kind, Kind::kObject);
  EXPECT_EQ(size->callee->text, "torch.Size");
  EXPECT_EQ(size->arguments->items[0]->items[1]->integer, 3);
  const auto* object = document.root->items[1];
  EXPECT_EQ(object->describe(), "m.C object");
  ASSERT_TRUE(object->state);
  EXPECT_TRUE(object->state->find("f")->boolean);
}

TEST(RestrictedUnpickler, AGetattrOfAClassIsTheNestedClassesNameAllowedOrRefusedByIt) {
  // getattr(m.C, "Inner") then NEWOBJ of it: how torch.save names ShardedTensor.ProcessGroupState.
  const char text[] =
      "\x80\x02"
      "c__builtin__\ngetattr\n"
      "cm\nC\n"
      "X\x05\x00\x00\x00Inner"
      "\x86R)\x81.";
  const std::vector<uint8_t> bytes(text, text + sizeof(text) - 1);  // the literal holds NUL bytes
  const auto document =
      restricted_unpickle(bytes.data(), bytes.size(), {"__builtin__.getattr", "m.C", "m.C.Inner"}, "test.pkl");
  ASSERT_EQ(document.root->kind, Kind::kObject);
  EXPECT_EQ(document.root->callee->text, "m.C.Inner");  // named, never looked up
  // Without the nested name in the allow-list, refused by that name (getattr itself being allowed).
  auto message = error_of(bytes, {"__builtin__.getattr", "m.C"});
  EXPECT_NE(message.find("references 'm.C.Inner'"), std::string::npos) << message;
  // getattr of anything but a class and a name is not a lookup this reader makes.
  const std::string odd =
      "\x80\x02"
      "c__builtin__\ngetattr\n"
      "K\x01K\x02\x86R.";
  message = error_of(std::vector<uint8_t>(odd.begin(), odd.end()), {"__builtin__.getattr"});
  EXPECT_NE(message.find("getattr of something other than a class and a name"), std::string::npos) << message;
}

TEST(RestrictedUnpickler, MalformedPicklesAreNamedErrors) {
  // Truncated: the dict pickle above cut in the middle of a string.
  auto bytes = from_hex("80049533000000000000007d948c0161945d94284b014740040000000000008c0178");
  bytes.resize(bytes.size() - 1);
  EXPECT_NE(error_of(bytes).find("a string of 1 bytes at byte 33 runs past the end of the pickle (0 bytes left)"),
            std::string::npos)
      << error_of(bytes);
  // Truncated inside an opcode's argument (BININT needs 4 bytes).
  EXPECT_NE(error_of(from_hex("80024a0100")).find("the pickle is truncated at byte 3 (4 more bytes needed, 2 left)"),
            std::string::npos)
      << error_of(from_hex("80024a0100"));
  // A persistent reference (BINPERSID, 'Q') where the caller allows none; an opcode the reader does
  // not know (PERSID, 'P', the text form).
  EXPECT_NE(
      error_of(from_hex("80024e512e")).find("a persistent reference (BINPERSID), which this file type does not hold"),
      std::string::npos);
  EXPECT_NE(error_of(from_hex("8002503f0a2e")).find("opcode 0x50 is not one the restricted reader knows"),
            std::string::npos);
  // TUPLE1 taking a value from below a MARK, which then pointed past the stack (found by
  // fuzz/restricted_unpickler_fuzz.cpp; fuzz/regressions/ holds the inputs).
  EXPECT_NE(error_of(from_hex("80024e28852e")).find("TUPLE1 needs 1 values on the stack above its innermost MARK"),
            std::string::npos)
      << error_of(from_hex("80024e28852e"));
  EXPECT_NE(error_of(from_hex("80024e2885742e")).find("TUPLE1 needs 1 values"), std::string::npos);
  // A memo entry read before it is written.
  EXPECT_NE(error_of(from_hex("8002680f2e")).find("memo entry 15 is read before it is written"), std::string::npos);
  // APPEND onto a dict, SETITEM onto a list, BUILD on an int, REDUCE of a string.
  EXPECT_NE(error_of(from_hex("80027d4b01612e")).find("APPEND on dict"), std::string::npos);
  EXPECT_NE(error_of(from_hex("80025d4b014b02732e")).find("SETITEM on list"), std::string::npos);
  EXPECT_NE(error_of(from_hex("80024b017d622e")).find("BUILD on int"), std::string::npos);
  EXPECT_NE(error_of(from_hex("80028c017829522e")).find("REDUCE of str, which is not a class or function reference"),
            std::string::npos)
      << error_of(from_hex("80028c017829522e"));
  // Two values left at STOP; an empty file; a string longer than the file.
  EXPECT_NE(error_of(from_hex("80024b014b022e")).find("ends with 2 values on its stack"), std::string::npos);
  EXPECT_NE(error_of({}).find("truncated at byte 0"), std::string::npos);
  EXPECT_NE(error_of(from_hex("800258ffffff7f")).find("runs past the end of the pickle"), std::string::npos);
  // An integer wider than 64 bits.
  EXPECT_NE(error_of(from_hex("80028a09000000000000000001"
                              "2e"))
                .find("beyond 64 bits"),
            std::string::npos);
}

TEST(RestrictedUnpickler, DeepNestingIsReadAndFreedWithoutRecursion) {
  // 200000 nested lists: [[[...]]], built with EMPTY_LIST then APPEND from the inside out.
  std::vector<uint8_t> bytes{0x80, 0x02};
  constexpr int kDepth = 200000;
  for (int index = 0; index < kDepth; ++index) bytes.push_back(']');
  for (int index = 0; index < kDepth - 1; ++index) bytes.push_back('a');
  bytes.push_back('.');
  const auto document = restricted_unpickle(bytes.data(), bytes.size(), {}, "test.pkl");
  EXPECT_EQ(document.root->kind, Kind::kList);
  EXPECT_EQ(document.arena.size(), static_cast<size_t>(kDepth));
}

}  // namespace
}  // namespace fsdp::detail

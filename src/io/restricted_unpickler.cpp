#include "io/restricted_unpickler.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <unordered_map>

namespace fsdp::detail {

const char* const kPersistentLoad = "persistent_load";

namespace {

using Kind = PickleValue::Kind;

// Bounds no pickle here comes near (a DCP .metadata of a large model has a few hundred thousand
// values); beyond them the file is hostile or broken.
constexpr size_t kMaxStack = size_t{1} << 24;
constexpr size_t kMaxMemo = size_t{1} << 24;

class Machine {
 public:
  Machine(const uint8_t* data, size_t size, const std::set<std::string>& allowed, const std::string& source)
      : data_(data), size_(size), allowed_(allowed), source_(source) {}

  PickleDocument run() {
    while (true) {
      const size_t at = position_;
      const uint8_t opcode = byte();
      switch (opcode) {
        case 0x80:  // PROTO
          TORCH_CHECK(byte() <= 5, where(at), "pickle protocol above 5");
          break;
        case 0x95:  // FRAME: an 8-byte length hint
          take(8);
          break;
        case '.': {  // STOP
          TORCH_CHECK(stack_.size() == 1 && marks_.empty(), where(at), "the pickle ends with ", stack_.size(),
                      " values on its stack instead of one");
          document_.root = stack_.back();
          return std::move(document_);
        }
        case '(':
          marks_.push_back(stack_.size());
          break;
        case '0':
          pop(at);
          break;
        case '1':
          pop_mark(at);
          break;
        case '2':
          TORCH_CHECK(!stack_.empty(), where(at), "DUP on an empty stack");
          push(stack_.back());
          break;
        case 'N':
          push(make(Kind::kNone));
          break;
        case 0x88:
        case 0x89: {
          auto* value = make(Kind::kBool);
          value->boolean = opcode == 0x88;
          push(value);
          break;
        }
        case 'J':
          push_int(static_cast<int32_t>(little_endian(4)));
          break;
        case 'K':
          push_int(byte());
          break;
        case 'M':
          push_int(static_cast<int64_t>(little_endian(2)));
          break;
        case 0x8a:
        case 0x8b: {  // LONG1, LONG4: little-endian two's complement of n bytes
          const size_t length = opcode == 0x8a ? byte() : little_endian(4);
          TORCH_CHECK(length <= 8, where(at), "an integer of ", length, " bytes, beyond 64 bits");
          const uint8_t* bytes = take(length);
          uint64_t bits = 0;
          for (size_t index = 0; index < length; ++index) bits |= static_cast<uint64_t>(bytes[index]) << (8 * index);
          if (length > 0 && length < 8 && (bytes[length - 1] & 0x80)) bits |= ~uint64_t{0} << (8 * length);
          push_int(static_cast<int64_t>(bits));
          break;
        }
        case 'G': {  // BINFLOAT: big-endian double
          const uint8_t* bytes = take(8);
          uint64_t bits = 0;
          for (int index = 0; index < 8; ++index) bits = (bits << 8) | bytes[index];
          auto* value = make(Kind::kFloat);
          std::memcpy(&value->floating, &bits, sizeof(bits));
          push(value);
          break;
        }
        case 0x8c:
          push_text(Kind::kString, byte());
          break;
        case 'X':
          push_text(Kind::kString, little_endian(4));
          break;
        case 0x8d:
          push_text(Kind::kString, little_endian(8));
          break;
        case 'C':
          push_text(Kind::kBytes, byte());
          break;
        case 'B':
          push_text(Kind::kBytes, little_endian(4));
          break;
        case 0x8e:
          push_text(Kind::kBytes, little_endian(8));
          break;
        case ')':
          push(make(Kind::kTuple));
          break;
        case 0x85:
        case 0x86:
        case 0x87: {
          const size_t count = opcode - 0x84;
          // Values below the innermost MARK belong to an enclosing tuple, list or dict.
          TORCH_CHECK(stack_.size() >= count + (marks_.empty() ? 0 : marks_.back()), where(at), "TUPLE", count,
                      " needs ", count, " values on the stack above its innermost MARK");
          auto* tuple = make(Kind::kTuple);
          tuple->items.assign(stack_.end() - static_cast<std::ptrdiff_t>(count), stack_.end());
          stack_.resize(stack_.size() - count);
          push(tuple);
          break;
        }
        case 't': {
          auto* tuple = make(Kind::kTuple);
          tuple->items = pop_mark(at);
          push(tuple);
          break;
        }
        case ']':
          push(make(Kind::kList));
          break;
        case 'l': {
          auto* list = make(Kind::kList);
          list->items = pop_mark(at);
          push(list);
          break;
        }
        case 'a': {
          auto* item = pop(at);
          container(at, Kind::kList, "APPEND")->items.push_back(item);
          break;
        }
        case 'e': {
          auto items = pop_mark(at);
          auto* list = container(at, Kind::kList, "APPENDS");
          list->items.insert(list->items.end(), items.begin(), items.end());
          break;
        }
        case '}':
          push(make(Kind::kDict));
          break;
        case 'd': {
          auto* dict = make(Kind::kDict);
          dict->items = pop_mark(at);
          TORCH_CHECK(dict->items.size() % 2 == 0, where(at), "DICT with an odd number of keys and values");
          push(dict);
          break;
        }
        case 's': {
          auto* value = pop(at);
          auto* key = pop(at);
          auto* dict = container(at, Kind::kDict, "SETITEM");
          dict->items.push_back(key);
          dict->items.push_back(value);
          break;
        }
        case 'u': {
          auto items = pop_mark(at);
          TORCH_CHECK(items.size() % 2 == 0, where(at), "SETITEMS with an odd number of keys and values");
          auto* dict = container(at, Kind::kDict, "SETITEMS");
          dict->items.insert(dict->items.end(), items.begin(), items.end());
          break;
        }
        case 'c': {  // GLOBAL: "module\nname\n"
          const auto module = line(at);
          const auto name = line(at);
          push(global(at, module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          auto* name = pop(at);
          auto* module = pop(at);
          TORCH_CHECK(module->kind == Kind::kString && name->kind == Kind::kString, where(at),
                      "STACK_GLOBAL needs a module and a name (strings), got ", module->describe(), " and ",
                      name->describe());
          push(global(at, module->text, name->text));
          break;
        }
        case 'R':     // REDUCE: callee(*arguments)
        case 0x81: {  // NEWOBJ: cls.__new__(cls, *arguments)
          auto* arguments = pop(at);
          auto* callee = pop(at);
          TORCH_CHECK(callee->kind == Kind::kGlobal, where(at), opcode == 'R' ? "REDUCE" : "NEWOBJ", " of ",
                      callee->describe(), ", which is not a class or function reference");
          TORCH_CHECK(arguments->kind == Kind::kTuple, where(at), "the arguments of ", callee->text, " are a ",
                      arguments->describe(), ", not a tuple");
          if (opcode == 'R' && (callee->text == "__builtin__.getattr" || callee->text == "builtins.getattr")) {
            // getattr(cls, "Name"): how a pickle names a nested class (ShardedTensor.ProcessGroupState).
            // It becomes the global "module.cls.Name", allowed or refused by that name like any other.
            TORCH_CHECK(arguments->items.size() == 2 && arguments->items[0]->kind == Kind::kGlobal &&
                            arguments->items[1]->kind == Kind::kString,
                        where(at), "getattr of something other than a class and a name");
            push(global(at, arguments->items[0]->text, arguments->items[1]->text));
            break;
          }
          if (callee->text == "collections.OrderedDict" && arguments->items.empty()) {
            // A dict subclass whose order is the insertion order a kDict keeps anyway: SETITEMS fill
            // it, and the BUILD that may follow (model.state_dict()'s _metadata) is recorded only.
            auto* dict = make(Kind::kDict);
            dict->callee = callee;
            push(dict);
            break;
          }
          auto* object = make(Kind::kObject);
          object->callee = callee;
          object->arguments = arguments;
          push(object);
          break;
        }
        case 'Q': {  // BINPERSID: persistent_load(pid), how torch.save refers to its storages
          auto* pid = pop(at);
          TORCH_CHECK(allowed_.count(kPersistentLoad), where(at),
                      "a persistent reference (BINPERSID), which this file type does not hold");
          auto* callee = make(Kind::kGlobal);
          callee->text = kPersistentLoad;
          auto* arguments = make(Kind::kTuple);
          arguments->items.push_back(pid);
          auto* object = make(Kind::kObject);
          object->callee = callee;
          object->arguments = arguments;
          push(object);
          break;
        }
        case 'b': {  // BUILD: obj.__setstate__(state)
          auto* state = pop(at);
          TORCH_CHECK(!stack_.empty() && (stack_.back()->kind == Kind::kObject ||
                                          (stack_.back()->kind == Kind::kDict && stack_.back()->callee != nullptr)),
                      where(at), "BUILD on ",
                      stack_.empty() ? std::string("an empty stack") : stack_.back()->describe(), ", not on an object");
          TORCH_CHECK(stack_.back()->state == nullptr, where(at), "BUILD of ", stack_.back()->describe(), " twice");
          const_cast<PickleValue*>(stack_.back())->state = state;
          break;
        }
        case 'q':
          put(at, byte());
          break;
        case 'r':
          put(at, little_endian(4));
          break;
        case 0x94:  // MEMOIZE: the next index is the memo's size, as in Python's unpickler
          put(at, memo_.size());
          break;
        case 'h':
          get(at, byte());
          break;
        case 'j':
          get(at, little_endian(4));
          break;
        default:
          TORCH_CHECK(false, where(at), "opcode 0x", hex(opcode),
                      " is not one the restricted reader knows (it reads the plain data, dataclasses and reduce "
                      "tuples a DCP checkpoint holds)");
      }
    }
  }

 private:
  std::string where(size_t at) const { return "'" + source_ + "': pickle byte " + std::to_string(at) + ": "; }
  static std::string hex(uint8_t value) {
    const char* digits = "0123456789abcdef";
    return std::string{digits[value >> 4], digits[value & 15]};
  }

  const uint8_t* take(size_t count) {
    TORCH_CHECK(count <= size_ - position_, "'", source_, "': the pickle is truncated at byte ", position_, " (", count,
                " more bytes needed, ", size_ - position_, " left)");
    const uint8_t* bytes = data_ + position_;
    position_ += count;
    return bytes;
  }
  uint8_t byte() { return *take(1); }
  uint64_t little_endian(size_t count) {
    const uint8_t* bytes = take(count);
    uint64_t value = 0;
    for (size_t index = 0; index < count; ++index) value |= static_cast<uint64_t>(bytes[index]) << (8 * index);
    return value;
  }
  std::string line(size_t at) {
    const size_t start = position_;
    while (position_ < size_ && data_[position_] != '\n') ++position_;
    TORCH_CHECK(position_ < size_, where(at), "GLOBAL's name runs to the end of the file");
    std::string text(reinterpret_cast<const char*>(data_ + start), position_ - start);
    ++position_;
    return text;
  }

  PickleValue* make(Kind kind) {
    document_.arena.push_back(std::make_unique<PickleValue>());
    document_.arena.back()->kind = kind;
    return document_.arena.back().get();
  }
  void push(const PickleValue* value) {
    TORCH_CHECK(stack_.size() < kMaxStack, "'", source_, "': the pickle's stack exceeds ", kMaxStack, " values");
    stack_.push_back(value);
  }
  void push_int(int64_t integer) {
    auto* value = make(Kind::kInt);
    value->integer = integer;
    push(value);
  }
  void push_text(Kind kind, uint64_t length) {
    TORCH_CHECK(length <= size_ - position_, "'", source_, "': a string of ", length, " bytes at byte ", position_,
                " runs past the end of the pickle (", size_ - position_, " bytes left)");
    const uint8_t* bytes = take(static_cast<size_t>(length));
    auto* value = make(kind);
    value->text.assign(reinterpret_cast<const char*>(bytes), static_cast<size_t>(length));
    push(value);
  }
  const PickleValue* pop(size_t at) {
    TORCH_CHECK(stack_.size() > (marks_.empty() ? 0 : marks_.back()), where(at), "a value is needed but the stack ",
                stack_.empty() ? "is empty" : "has none above its mark");
    const PickleValue* value = stack_.back();
    stack_.pop_back();
    return value;
  }
  std::vector<const PickleValue*> pop_mark(size_t at) {
    TORCH_CHECK(!marks_.empty(), where(at), "no MARK to pop to");
    const size_t mark = marks_.back();
    marks_.pop_back();
    TORCH_INTERNAL_ASSERT(mark <= stack_.size(), "restricted unpickler: a value below a MARK was consumed");
    std::vector<const PickleValue*> items(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }
  PickleValue* container(size_t at, Kind kind, const char* opcode) {
    TORCH_CHECK(!stack_.empty() && stack_.back()->kind == kind, where(at), opcode, " on ",
                stack_.empty() ? std::string("an empty stack") : stack_.back()->describe());
    return const_cast<PickleValue*>(stack_.back());
  }
  const PickleValue* global(size_t at, const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    TORCH_CHECK(allowed_.count(full), where(at), "references '", full,
                "', which this file type does not hold; it is refused, because loading never executes code or builds "
                "unknown objects. If the file comes from a newer PyTorch, report the class name");
    auto* value = make(Kind::kGlobal);
    value->text = full;
    return value;
  }
  void put(size_t at, uint64_t index) {
    TORCH_CHECK(!stack_.empty(), where(at), "memoizing from an empty stack");
    TORCH_CHECK(memo_.size() < kMaxMemo, where(at), "the memo exceeds ", kMaxMemo, " entries");
    memo_[index] = stack_.back();
  }
  void get(size_t at, uint64_t index) {
    auto found = memo_.find(index);
    TORCH_CHECK(found != memo_.end(), where(at), "memo entry ", index, " is read before it is written");
    push(found->second);
  }

  const uint8_t* data_;
  size_t size_;
  size_t position_ = 0;
  const std::set<std::string>& allowed_;
  const std::string& source_;
  PickleDocument document_;
  std::vector<const PickleValue*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, const PickleValue*> memo_;
};

}  // namespace

std::string PickleValue::describe() const {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kGlobal:
      return text;
    case Kind::kObject:
      return callee->text + " object";
  }
  return "?";
}

const PickleValue* PickleValue::find(const std::string& key) const {
  if (kind != Kind::kDict) return nullptr;
  for (size_t index = 0; index + 1 < items.size(); index += 2) {
    if (items[index]->kind == Kind::kString && items[index]->text == key) return items[index + 1];
  }
  return nullptr;
}

PickleDocument restricted_unpickle(const uint8_t* data, size_t size, const std::set<std::string>& allowed_globals,
                                   const std::string& source) {
  return Machine(data, size, allowed_globals, source).run();
}

}  // namespace fsdp::detail

// A pickle reader for files written by Python that must be read without running Python: the
// `.metadata` of PyTorch's distributed checkpoints (DCP) and the small objects inside them.
//
// Note [a restricted unpickler]
// A pickle is a program for a stack machine whose GLOBAL, REDUCE and NEWOBJ opcodes import and
// call arbitrary Python. This reader runs the machine without calling anything: a global becomes a
// named value, and a call or a NEWOBJ of an allowed global becomes an Object holding the callee, its
// arguments and (after BUILD) its state, for the caller to interpret by name. A global outside the
// caller's allow-list is an error naming it, so loading never executes code and never builds an
// object the caller does not know. Every value lives in the document's arena and refers to others
// by pointer, so memo references, shared and even cyclic structures cost nothing and are freed
// without recursion; readers of the tree bound their own depth. Every length and offset is checked
// against the bytes; a truncated or malformed pickle is an error naming the byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp::detail {

struct PickleValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kBytes, kTuple, kList, kDict, kGlobal, kObject };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double floating = 0;
  /// kString, kBytes; kGlobal: "module.name".
  std::string text;
  /// kTuple, kList: the elements; kDict: keys and values alternating, in insertion order.
  std::vector<const PickleValue*> items;
  /// kObject: the global called or instantiated, its argument tuple, and the BUILD state (or null).
  /// kDict made by `collections.OrderedDict()`: that global and the BUILD state (its instance
  /// attributes, such as model.state_dict()'s _metadata), recorded and otherwise ignored.
  const PickleValue* callee = nullptr;
  const PickleValue* arguments = nullptr;
  const PickleValue* state = nullptr;

  /// "None", "int", "str", "tuple", ..., or the global's / object class's name.
  std::string describe() const;
  /// For kDict: the value of string key `key`, or null.
  const PickleValue* find(const std::string& key) const;
};

struct PickleDocument {
  std::vector<std::unique_ptr<PickleValue>> arena;
  const PickleValue* root = nullptr;
};

/// The name under which a persistent reference (BINPERSID: torch.save's storages) appears, as an
/// Object whose callee is this name and whose one argument is the reference; allowed only when
/// `allowed_globals` holds it.
extern const char* const kPersistentLoad;

/// Runs the pickle in `data` (protocols 2 to 5 and the opcodes Python's pickler emits for builtins,
/// dataclasses and reduce tuples). `allowed_globals` lists "module.name" entries the pickle may
/// reference; `source` names the file in errors.
PickleDocument restricted_unpickle(const uint8_t* data, size_t size, const std::set<std::string>& allowed_globals,
                                   const std::string& source);

}  // namespace fsdp::detail

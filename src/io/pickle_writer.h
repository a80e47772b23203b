// A writer of Python pickles (protocol 2) for files that Python reads with pickle.load: the
// `.metadata` of the distributed checkpoints fsdp.cpp writes. The reader's counterpart is
// restricted_unpickler.h; this one only emits opcodes, and the caller composes them in the order
// Python's pickler would (a dataclass: the class, NEWOBJ, then BUILD with its field dict).
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

class PickleWriter {
 public:
  /// Starts the pickle (PROTO 2).
  PickleWriter();
  void none();
  void boolean(bool value);
  void integer(int64_t value);
  void floating(double value);
  /// A str (UTF-8).
  void string(const std::string& value);
  /// A reference to `module`.`name` (GLOBAL).
  void global(const std::string& module, const std::string& name);
  void mark();
  /// The items since the last mark as a tuple.
  void tuple_from_mark();
  void empty_tuple();
  void empty_dict();
  /// Key-value pairs pushed since the last mark go into the dict below the mark.
  void set_items_from_mark();
  void empty_list();
  /// Items pushed since the last mark are appended to the list below the mark.
  void appends_from_mark();
  /// callable, argument tuple -> callable(*arguments).
  void reduce();
  /// class, argument tuple -> class.__new__(class, *arguments).
  void new_object();
  /// object, state -> object with the state applied (a dataclass's field dict).
  void build();
  /// Stores the value on top of the stack in memo slot `index` (LONG_BINPUT).
  void put(uint32_t index);
  /// Pushes memo slot `index` (LONG_BINGET): the same object again.
  void get(uint32_t index);
  /// Ends the pickle (STOP) and returns its bytes.
  std::string finish();

 private:
  std::string bytes_;
};

}  // namespace fsdp::detail

// The message of the c10::Error a call throws, or "" when it throws nothing: lets a test assert on
// what a user would read.
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace fsdp::testing {

inline std::string error_message_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  }
  return "";
}

}  // namespace fsdp::testing

// Private: byte counts as people read them, shared by the subcommands that print sizes.
#pragma once

#include <cstdio>
#include <string>

namespace fsdp::cli {

/// `bytes` in decimal units (1 GB = 1e9 B, as `ls -h --si` and disk makers count), with `decimals`
/// digits after the point; whole bytes are printed without any.
inline std::string human_bytes(double bytes, int decimals) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int unit = 0;
  while (bytes >= 1000 && unit < 5) {
    bytes /= 1000;
    ++unit;
  }
  char text[48];
  std::snprintf(text, sizeof(text), "%.*f %s", unit == 0 ? 0 : decimals, bytes, units[unit]);
  return text;
}

}  // namespace fsdp::cli

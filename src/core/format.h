// tessera/core/format.h — numbers as short text: the way printf's "%g" writes them, and with thousands separators.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace tessera {

// 6 significant digits without trailing zeros: "50", "0.25", "1e+06".
inline std::string format_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// 1234567 -> "1,234,567", -1234 -> "-1,234".
inline std::string with_commas(int64_t n) {
  std::string s = std::to_string(n < 0 ? -n : n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return (n < 0 ? "-" : "") + s;
}

}  // namespace tessera

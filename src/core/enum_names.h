// tessera/core/enum_names.h — the names of an enum whose enumerators are numbered 0, 1, 2, ... written once,
// as an array in the enum's order: the name of a value and the value of a name.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace tessera {

// names[value]; "unknown" for a number past the end.
template <class E, size_t N>
constexpr std::string_view enum_name(const std::string_view (&names)[N], E value) {
  const auto i = static_cast<size_t>(value);
  return i < N ? names[i] : "unknown";
}

// The value whose name is `name`, or nothing.
template <class E, size_t N>
constexpr std::optional<E> enum_value(const std::string_view (&names)[N], std::string_view name) {
  for (size_t i = 0; i < N; ++i) {
    if (names[i] == name) return static_cast<E>(i);
  }
  return std::nullopt;
}

}  // namespace tessera

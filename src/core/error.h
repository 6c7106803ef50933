// tessera/core/error.h — the one error type of the library.
//
// Library code never aborts on bad input: it throws tessera::Error with a message a user can act on
// (which file, which tensor, which layer/head/field, what was expected).
#pragma once

#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error(message) when cond is false. For checks on inputs, not for internal invariants.
inline void check(bool cond, const std::string& message) {
  if (!cond) throw Error(message);
}

}  // namespace tessera

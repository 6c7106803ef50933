// tessera/core/error.h — the one error type of the library.
//
// Library code never aborts on bad input: it throws tessera::Error with a message a user can act on
// (which file, which tensor, which layer/head/field, what was expected).
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error(message) when cond is false. For checks on inputs, not for internal invariants.
inline void check(bool cond, const std::string& message) {
  if (!cond) throw Error(message);
}
// The same with the message built only when cond is false: check(n > 0, [&] { return "... " +
// std::to_string(n); }) on paths that run per layer and chunk, where building the message every call costs
// (the streaming decisions).
template <class Message>
requires std::is_invocable_r_v<std::string, Message>
inline void check(bool cond, Message&& message) {
  if (!cond) throw Error(std::forward<Message>(message)());
}

}  // namespace tessera

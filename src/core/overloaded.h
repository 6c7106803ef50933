// tessera/core/overloaded.h — a visitor built from lambdas, for std::visit over variants (patterns, estimates).
#pragma once

namespace tessera {

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

}  // namespace tessera

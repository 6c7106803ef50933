// bench/gpu/bench_args.h — what the GPU benches' option parsers share.
#pragma once

#include <sstream>
#include <string>
#include <vector>

namespace tessera::bench {

// "a,b,,c" split at `sep`, empty items dropped: {"a", "b", "c"}.
inline std::vector<std::string> split_list(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace tessera::bench

#include "core/memory_budget.h"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>

#include "core/error.h"

namespace tessera {

namespace {

std::atomic<int64_t> g_override{0};
std::string g_override_source;  // written before g_override (set_host_memory_budget), read after it

int64_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : std::numeric_limits<int64_t>::max();
}

// cgroup v2 memory.max of this process's group ("max" or absent: no limit).
int64_t cgroup_limit() {
  std::ifstream in("/sys/fs/cgroup/memory.max");
  std::string s;
  if (!(in >> s) || s == "max" || s.empty()) return std::numeric_limits<int64_t>::max();
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::numeric_limits<int64_t>::max();
  try {
    return std::stoll(s);
  } catch (...) {
    return std::numeric_limits<int64_t>::max();
  }
}

}  // namespace

int64_t parse_byte_size(const std::string& text, const std::string& what) {
  const auto fail = [&]() -> int64_t {
    throw Error(what + ": '" + text + "' is not a size (write e.g. 24G, 512M, 1.5G or a number of bytes)");
  };
  if (text.empty()) return fail();
  size_t end = 0;
  double v = 0;
  try {
    v = std::stod(text, &end);
  } catch (...) {
    return fail();
  }
  std::string unit = text.substr(end);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (unit == "i") return fail();
  if (unit.size() == 2 && (unit[1] == 'i' || unit[1] == 'I')) unit.pop_back();  // 24GiB = 24G: binary units
  double scale = 1;
  if (unit.empty()) scale = 1;
  else if (unit == "K" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "m") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  else return fail();
  const double bytes = v * scale;
  if (!std::isfinite(bytes) || bytes <= 0 || bytes >= 9.2e18)
    throw Error(what + ": '" + text + "' must be a positive size below 8 EiB");
  return static_cast<int64_t>(bytes);
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  while (bytes >= 1000 && u < 6) {
    bytes /= 1000;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  else std::snprintf(buf, sizeof buf, bytes < 10 ? "%.2f %s" : bytes < 100 ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

void set_host_memory_budget(int64_t bytes, std::string source) {
  g_override_source = std::move(source);
  g_override.store(bytes > 0 ? bytes : 0);
}

MemoryBudget host_memory_budget() {
  if (const int64_t b = g_override.load(); b > 0) return {b, g_override_source};
  if (const char* env = std::getenv("TESSERA_MEMORY_BUDGET"); env != nullptr && *env != '\0')
    return {parse_byte_size(env, "TESSERA_MEMORY_BUDGET"), "TESSERA_MEMORY_BUDGET"};
  const int64_t phys = physical_memory(), cg = cgroup_limit();
  if (cg < phys) return {cg, "cgroup memory limit"};
  return {phys, "physical memory"};
}

void check_host_allocation(const std::string& what, double bytes, const std::string& remedy) {
  const MemoryBudget budget = host_memory_budget();
  if (bytes >= 0 && bytes <= static_cast<double>(budget.bytes)) return;
  const std::string need = bytes >= 0 && bytes < 9.2e18 ? format_bytes(bytes) : "more than 9.2 EB";
  throw Error(what + " needs " + need + ", over the host memory budget of " +
              format_bytes(static_cast<double>(budget.bytes)) + " (" + budget.source + "); " + remedy +
              ", or change the budget with --memory-budget or TESSERA_MEMORY_BUDGET");
}

}  // namespace tessera

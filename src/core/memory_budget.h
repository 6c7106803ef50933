// tessera/core/memory_budget.h — the host memory budget every input-sized allocation is checked against first.
//
// The rule (issue 22): every allocation whose size follows from user input (weights dequantized at load, the KV
// cache, a prompt, a policy table, a vocabulary) is compared with a stated budget *before* it is made, and a
// request over the budget fails with a tessera::Error saying what needed how much, the budget, and how to change
// either — instead of the process dying (or swapping) once the machine's memory is gone.
//
//   check_host_allocation("KV cache for 131,072 tokens (24 layers x 3 kv heads x 64 dims, K and V in f32)",
//                         bytes, "lower --max-context or shorten the prompt");
//
// The budget is, in order: set_host_memory_budget() (the CLI's --memory-budget), the TESSERA_MEMORY_BUDGET
// environment variable ("24G", "512M", "1.5G" or bytes), else the machine's physical memory (the cgroup limit
// when lower). It bounds each allocation on its own, not their sum: the point is to refuse sizes that can never
// fit, with the number, rather than to account for every byte.
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

struct MemoryBudget {
  int64_t bytes = 0;
  std::string source;  // "--memory-budget", "TESSERA_MEMORY_BUDGET", "physical memory", "cgroup memory limit"
};

// The budget in force (see above).
MemoryBudget host_memory_budget();
// Overrides the budget for this process (0: back to the environment / physical memory).
void set_host_memory_budget(int64_t bytes, std::string source = "--memory-budget");

// "24G", "512M", "64K", "1.5G", "1000000" -> bytes. Throws tessera::Error naming `what` on anything else.
int64_t parse_byte_size(const std::string& text, const std::string& what);
// 1536 MiB -> "1.61 GB" (decimal units, three significant digits).
std::string format_bytes(double bytes);

// Throws tessera::Error when `bytes` exceeds the budget:
//   "<what> needs 12.9 GB, over the host memory budget of 8.00 GB (physical memory); <remedy>, or change the
//    budget with --memory-budget or TESSERA_MEMORY_BUDGET"
// Negative `bytes` (an overflowed size computation) fail the same way, as "more than 9.2 EB".
void check_host_allocation(const std::string& what, double bytes, const std::string& remedy);

}  // namespace tessera

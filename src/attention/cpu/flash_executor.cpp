#include "attention/cpu/flash_executor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

#include "attention/cpu/cpu_kernel.h"
#include "attention/cpu/flash_tile.h"
#include "attention/cpu/paged_decode.h"
#include "core/buffer.h"
#include "core/enum_names.h"
#include "core/error.h"

namespace tessera::attn {

namespace {
std::atomic<CpuKernel> g_kernel{CpuKernel::Auto};
}  // namespace

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

void set_cpu_kernel(CpuKernel kernel) {
  check(kernel != CpuKernel::Avx512 || cpu_has_avx512(),
        "set_cpu_kernel: this CPU does not support AVX-512 (F, BW, VL, DQ)");
  g_kernel.store(kernel);
}

CpuKernel active_cpu_kernel() {
  const CpuKernel k = g_kernel.load();
  if (k != CpuKernel::Auto) return k;
  return cpu_has_avx512() ? CpuKernel::Avx512 : CpuKernel::Baseline;
}

std::string_view cpu_kernel_name(CpuKernel kernel) {
  static constexpr std::string_view kNames[] = {"auto", "baseline", "avx512"};  // in CpuKernel's order
  return enum_name(kNames, kernel);
}

namespace cpu_detail {

void execute_items(const AttentionArgs& args, std::vector<WorkItem>& items, ThreadPool& pool) {
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const int d = static_cast<int>(args.head_dim());
  const size_t scratch_floats = tile_scratch_floats(d);
  std::vector<Buffer> scratch;
  scratch.reserve(static_cast<size_t>(pool.size()));
  for (int w = 0; w < pool.size(); ++w) scratch.emplace_back(scratch_floats * sizeof(float));

  auto* run_tile = active_cpu_kernel() == CpuKernel::Avx512 ? &run_tile_avx512 : &run_tile_baseline;
  const float scale = args.effective_scale();
  const auto elem = [](DType t) {
    return t == DType::BF16 ? KvElem::BF16 : t == DType::F16 ? KvElem::F16 : KvElem::F32;
  };
  const bool q_bf16 = args.q.dtype == DType::BF16;
  const KvElem k_elem = elem(args.k.dtype), v_elem = elem(args.v.dtype);
  const size_t q_es = q_bf16 ? 2 : 4, k_es = dtype_size(args.k.dtype), v_es = dtype_size(args.v.dtype);
  const int64_t group = args.group_size();

  pool.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i, int worker) {
    const WorkItem& it = items[static_cast<size_t>(i)];
    const int64_t g = it.head / group;
    TileJob job;
    job.q = static_cast<const char*>(args.q.data) +
            (it.row_begin * args.q.stride[0] + it.head * args.q.stride[1]) * static_cast<int64_t>(q_es);
    job.q_rs = args.q.stride[0];
    job.q_cs = args.q.stride[2];
    job.q_bf16 = q_bf16;
    job.k = static_cast<const char*>(args.k.data) + g * args.k.stride[1] * static_cast<int64_t>(k_es);
    job.k_rs = args.k.stride[0];
    job.k_cs = args.k.stride[2];
    job.k_elem = k_elem;
    job.v = static_cast<const char*>(args.v.data) + g * args.v.stride[1] * static_cast<int64_t>(v_es);
    job.v_rs = args.v.stride[0];
    job.v_cs = args.v.stride[2];
    job.v_elem = v_elem;
    job.out = args.out.at<float>(it.row_begin, it.head, 0);
    job.out_rs = args.out.stride[0];
    job.out_cs = args.out.stride[2];
    if (args.has_lse()) {
      job.lse = args.lse.at<float>(it.head, it.row_begin);
      job.lse_rs = args.lse.stride[1];
    }
    job.rows = it.rows;
    job.heads = it.heads;
    job.q_hs = args.q.stride[1];
    job.out_hs = args.out.stride[1];
    job.lse_hs = args.has_lse() ? args.lse.stride[0] : 0;
    job.head_dim = d;
    job.first_pos = args.q_begin + it.row_begin;
    job.window = args.window;
    job.scale = scale;
    job.ranges = it.ranges;
    job.num_ranges = it.num_ranges;
    job.columns = it.columns;
    job.num_columns = it.num_columns;
    run_tile(job, static_cast<float*>(scratch[static_cast<size_t>(worker)].data()));
  });
}

}  // namespace cpu_detail

static_assert(kPagedTileKeys == cpu_detail::kKeyBlock, "paged_decode.h's kPagedTileKeys is the tile's key block");

size_t paged_tile_scratch_floats(int32_t head_dim) {
  return cpu_detail::tile_scratch_floats(head_dim);
}

void paged_decode_in_prefill_order(const PagedTileJob& job, float* scratch) {
  using cpu_detail::KvElem;
  check(job.elem == DType::F32 || job.elem == DType::BF16 || job.elem == DType::F16,
        "paged decode attention: keys and values in " + std::string(dtype_name(job.elem)) +
            " (expected f32, bf16 or f16)");
  check(job.heads >= 1 && job.head_dim >= 1 && job.block_tokens >= 1 && job.pos >= 0 && job.key_begin >= 0 &&
            job.key_begin <= job.pos,
        "paged decode attention (prefill order): " + std::to_string(job.heads) + " heads of dimension " +
            std::to_string(job.head_dim) + ", keys [" + std::to_string(job.key_begin) + ", " +
            std::to_string(job.pos) + "], blocks of " + std::to_string(job.block_tokens));
  auto* run_tile = active_cpu_kernel() == CpuKernel::Avx512 ? &cpu_detail::run_tile_avx512
                                                            : &cpu_detail::run_tile_baseline;
  const KvElem elem = job.elem == DType::BF16 ? KvElem::BF16 : job.elem == DType::F16 ? KvElem::F16 : KvElem::F32;
  // The walk starts at key_begin's 64-key block, as the dense executor's (dense_attention.cpp).
  const KeyRange range{job.key_begin / cpu_detail::kKeyBlock * cpu_detail::kKeyBlock, job.pos + 1};
  for (int32_t h = 0; h < job.heads; h += cpu_detail::kFewRows) {
    cpu_detail::TileJob t;
    t.q = job.q + static_cast<int64_t>(h) * job.head_dim;
    t.q_rs = job.head_dim;
    t.q_cs = 1;
    t.q_hs = job.head_dim;
    t.k_rs = t.v_rs = job.head_dim;
    t.k_cs = t.v_cs = 1;
    t.k_elem = t.v_elem = elem;
    t.out = job.out + static_cast<int64_t>(h) * job.head_dim;
    t.out_rs = t.out_hs = job.head_dim;
    t.out_cs = 1;
    t.rows = 1;
    t.heads = std::min(cpu_detail::kFewRows, job.heads - h);
    t.head_dim = job.head_dim;
    t.first_pos = job.pos;
    t.window = job.window;
    t.scale = job.scale != 0 ? job.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(job.head_dim)));
    t.ranges = &range;
    t.num_ranges = 1;
    t.k_blocks = job.k_blocks;
    t.v_blocks = job.v_blocks;
    t.block_tokens = job.block_tokens;
    run_tile(t, scratch);
  }
}

}  // namespace tessera::attn

// Host emulation of the adaptive VS budgets on the device (vs_topk_kernel with VsCoverage, estimate_kernels.cuh)
// against the rule of attention/index/estimate.h's coverage_count evaluated directly: the forced [0, forced)
// first, then the others by order key descending (ties to the smaller index), the shortest prefix whose mass (f64,
// summed in that order) reaches gamma * total, clamped to [max(min, forced), max]; the kept indices ascending,
// then kVsUnused up to the layout's room. Rows: positive column-sum-like masses (exp of a Gaussian), masses with
// many exact ties (multiples of 1/4, where the f64 sums are exact, so the tie arithmetic is checked exactly),
// rows with zeros; gamma 0.3 .. 1; random forced, min and max; then two 131072-entry rows (the 128K shape).
#include <cstdio>
#include <numeric>
#include <random>

#include "shim.h"  // first: the CUDA execution model the real device headers below compile against

#include "attention/cuda/estimate_kernels.cuh"

using namespace tessera::attn::gpu;

namespace {
int g_bad = 0, g_rows = 0;

dim3 d3(unsigned x, unsigned y = 1) {
  dim3 r;
  r.x = x;
  r.y = y;
  return r;
}

std::vector<int32_t> reference(const std::vector<float>& row, int forced, double gamma, int min_count, int room) {
  const int n = int(row.size());
  forced = std::min(forced, room);
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin() + forced, order.end(), [&](int a, int b) {
    return tessera::attn::gpu::detail::order_key(row[size_t(a)]) > tessera::attn::gpu::detail::order_key(row[size_t(b)]);
  });
  double total = 0;
  for (float x : row) total += x;
  int count = n;
  if (gamma < 1.0 && total > 0) {
    double acc = 0;
    for (int c = 1; c <= n; ++c) {
      acc += row[size_t(order[size_t(c - 1)])];
      if (c >= forced && acc >= gamma * total) {
        count = c;
        break;
      }
    }
  }
  count = std::clamp(count, std::min(std::max(min_count, forced), room), room);
  std::vector<int32_t> out(order.begin(), order.begin() + count);
  std::sort(out.begin(), out.end());
  out.resize(size_t(room), kVsUnused);
  return out;
}

// One VS head whose column sums and diagonal sums are both `row`; columns get (forced, min, room) as given,
// offsets the fixed budget `room` (gamma applies to both; offsets use forced 0 and min 0).
void check_row(const std::vector<float>& row, int forced, double gamma, int min_count, int room, const char* what) {
  const int n = int(row.size());
  VsHeadDesc hd;
  hd.num_columns = room;
  hd.num_offsets = room;
  hd.forced_columns = std::min(forced, room);
  hd.forced_offsets = 0;
  hd.gamma = gamma;
  hd.min_columns = min_count;
  hd.min_offsets = 0;
  std::vector<int32_t> columns(size_t(room) + 1, -7), offsets(size_t(room) + 1, -7);
  std::vector<float> sums = row;
  VsParams p;
  p.keys = n;
  p.heads = &hd;
  p.colsum = sums.data();
  p.diag = sums.data();
  p.columns = columns.data();
  p.offsets = offsets.data();
  for (unsigned y = 0; y < 2; ++y) emu::run_block(d3(0, y), d3(kTopKThreads), [&] { vs_topk_kernel(p); });
  const std::vector<int32_t> want_c = reference(row, forced, gamma, min_count, room);
  const std::vector<int32_t> want_o = reference(row, 0, gamma, 0, room);
  const bool ok = std::equal(want_c.begin(), want_c.end(), columns.begin()) && columns[size_t(room)] == -7 &&
                  std::equal(want_o.begin(), want_o.end(), offsets.begin()) && offsets[size_t(room)] == -7;
  ++g_rows;
  if (!ok && g_bad++ < 5) {
    const auto kept = [](const std::vector<int32_t>& v) {
      return int(std::count_if(v.begin(), v.end(), [](int32_t x) { return x != kVsUnused && x != -7; }));
    };
    std::printf("%s: n %d forced %d gamma %g min %d room %d: kept %d / %d columns (want %d / %d)\n", what, n, forced,
                gamma, min_count, room, kept(columns), kept(offsets), kept(want_c), kept(want_o));
  }
}
}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 48;  // ~5 CPU seconds (more: pass a count)
  std::mt19937 rng(1616);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  const double gammas[] = {0.3, 0.8, 0.9, 0.95, 0.99, 1.0};
  for (int c = 0; c < cases; ++c) {
    const int n = 1 + int(rng() % (c % 3 == 0 ? 50 : 5000));
    const int mode = int(rng() % 3);
    std::vector<float> row(static_cast<size_t>(n));
    for (float& x : row) {
      if (mode == 0) x = std::exp(2.0f * gauss(rng)) * 1e-3f;
      else if (mode == 1) x = float(rng() % 5) * 0.25f;  // ties, zeros, exact sums
      else x = rng() % 4 == 0 ? 0.0f : std::fabs(gauss(rng));
    }
    const int room = 1 + int(rng() % n);
    const int forced = int(rng() % (std::min(room, 40) + 1));
    const int min_count = int(rng() % (room + 1));
    check_row(row, forced, gammas[rng() % 6], rng() % 3 == 0 ? min_count : 0, room, "random row");
  }
  // The 128K shape: positive sums concentrated on a few entries, room 6096 / all.
  for (int c = 0; c < 2; ++c) {
    std::vector<float> row(131072);
    for (float& x : row) x = std::exp(2.5f * gauss(rng)) * 1e-4f;
    check_row(row, c == 0 ? 30 : 100, c == 0 ? 0.9 : 0.95, 0, c == 0 ? 6096 : 131072, "131072 sums");
  }
  std::printf("vs coverage: %d of %d rows differ\n", g_bad, g_rows);
  return g_bad == 0 ? 0 : 1;
}

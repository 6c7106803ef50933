// Tests of the paged decode attention kernel (attention/cpu/paged_decode.h): every instruction-set path this
// CPU has (portable twin, AVX2, AVX-512) against an f64 reference over the same stored values, for each K/V
// type (f32, bf16, f16), head dims 64/128/256 and dims the SIMD paths leave to narrower ones, GQA groups 1..8
// and 11 (two passes of at most 8), key counts on and off the 16/64-key edges, spans of several sizes from
// scattered blocks, and large scores (the online softmax's rescale between chunks); split walks (a row's keys cut
// into parts, each with its running max and sum, merged by paged_decode_merge) against the unsplit walk and the
// reference, and the rule that picks the parts (paged_decode_parts).
#include "attention/cpu/paged_decode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu/cpu_kernel.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tessera::attn {
namespace {

std::vector<PagedIsa> available_isas() {
  std::vector<PagedIsa> v;
  for (PagedIsa isa : {PagedIsa::Portable, PagedIsa::Avx2, PagedIsa::Avx512})
    if (paged_decode_isa_available(isa)) v.push_back(isa);
  return v;
}

// Keys of one (sequence, kv head) kept in blocks of `block` rows, the blocks placed out of order in one
// store, as a paged store's are: rows in the type's bits (`bits`), and their exact f32 values (`values`) for
// the reference.
struct Store {
  int64_t d = 0, block = 0;
  DType type = DType::F32;
  std::vector<float> kf, vf;      // f32 store
  std::vector<uint16_t> kh, vh;   // half store
  std::vector<float> kval, vval;  // the stored values as f32, [row of the store][d]
  std::vector<int64_t> block_at;  // sequence block i -> store block

  Store(int64_t d_, int64_t block_, DType type_, int64_t rows, std::mt19937& rng, float kscale)
      : d(d_), block(block_), type(type_) {
    // The sequence's blocks in reverse order, store block 0 left unused.
    const int64_t nblocks = (rows + block - 1) / block + 1;
    const size_t n = static_cast<size_t>(nblocks * block * d);
    for (int64_t i = 0; i + 1 < nblocks; ++i) block_at.push_back(nblocks - 1 - i);
    std::normal_distribution<float> nd;
    kval.resize(n);
    vval.resize(n);
    for (size_t i = 0; i < n; ++i) {
      kval[i] = nd(rng) * kscale;
      vval[i] = nd(rng);
    }
    if (type == DType::F32) {
      kf = kval;
      vf = vval;
      return;
    }
    kh.resize(n);
    vh.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (type == DType::F16) {
        kh[i] = f32_to_f16(kval[i]).bits;
        vh[i] = f32_to_f16(vval[i]).bits;
        kval[i] = f16_to_f32(f16::from_bits(kh[i]));
        vval[i] = f16_to_f32(f16::from_bits(vh[i]));
      } else {
        kh[i] = f32_to_bf16(kval[i]).bits;
        vh[i] = f32_to_bf16(vval[i]).bits;
        kval[i] = bf16_to_f32(bf16::from_bits(kh[i]));
        vval[i] = bf16_to_f32(bf16::from_bits(vh[i]));
      }
    }
  }

  size_t offset(int64_t pos) const {
    return static_cast<size_t>((block_at[static_cast<size_t>(pos / block)] * block + pos % block) * d);
  }
  const void* k(int64_t pos) const {
    return type == DType::F32 ? static_cast<const void*>(kf.data() + offset(pos)) : kh.data() + offset(pos);
  }
  const void* v(int64_t pos) const {
    return type == DType::F32 ? static_cast<const void*>(vf.data() + offset(pos)) : vh.data() + offset(pos);
  }
  // Keys [j0, j1) as spans of at most `block` rows (cut at block edges).
  void add_spans(int64_t j0, int64_t j1, std::vector<KeySpan>& spans) const {
    while (j0 < j1) {
      const int64_t end = std::min(j1, (j0 / block + 1) * block);
      spans.push_back({k(j0), v(j0), end - j0});
      j0 = end;
    }
  }
};

// softmax(scale q k^T) V in f64 over the stored values of keys [a0, a1) and [b0, b1).
std::vector<double> reference(const Store& st, const std::vector<float>& q, int heads, float scale,
                              int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  const int64_t d = st.d;
  std::vector<double> out(static_cast<size_t>(heads * d), 0.0);
  std::vector<int64_t> keys;
  for (int64_t j = a0; j < a1; ++j) keys.push_back(j);
  for (int64_t j = b0; j < b1; ++j) keys.push_back(j);
  if (keys.empty()) return out;
  for (int g = 0; g < heads; ++g) {
    std::vector<double> s(keys.size());
    double mx = -INFINITY;
    for (size_t i = 0; i < keys.size(); ++i) {
      double dot = 0;
      const size_t at = st.offset(keys[i]);
      for (int64_t c = 0; c < d; ++c)
        dot += static_cast<double>(q[static_cast<size_t>(g * d + c)]) * st.kval[at + static_cast<size_t>(c)];
      s[i] = dot * scale;
      mx = std::max(mx, s[i]);
    }
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (size_t i = 0; i < keys.size(); ++i) {
      const size_t at = st.offset(keys[i]);
      for (int64_t c = 0; c < d; ++c)
        out[static_cast<size_t>(g * d + c)] += s[i] / sum * st.vval[at + static_cast<size_t>(c)];
    }
  }
  return out;
}

struct Case {
  int64_t d;
  int heads;
  int64_t block;
  int64_t len;   // keys [0, len) kept
  int64_t sink;  // >= 0: keys [0, sink) and [len - window, len) (MoA's view), else all
  int64_t window;
  float kscale;  // keys' spread (large: large scores)
  Case(int64_t d_, int heads_, int64_t block_, int64_t len_, int64_t sink_ = -1, int64_t window_ = 0,
       float kscale_ = 1)
      : d(d_), heads(heads_), block(block_), len(len_), sink(sink_), window(window_), kscale(kscale_) {}
};

// Runs a case on every path; each against the f64 reference within `tol` (absolute; values ~ N(0, 1)).
void check_case(const Case& c, DType type, uint32_t seed, double tol = 3e-5) {
  std::mt19937 rng(seed);
  const Store st(c.d, c.block, type, c.len, rng, c.kscale);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(c.heads * c.d));
  for (float& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  int64_t a0 = 0, a1 = c.len, b0 = c.len, b1 = c.len;
  if (c.sink >= 0) {
    a1 = std::min(c.sink, c.len);
    b0 = std::max(a1, c.len - c.window);
  }
  std::vector<KeySpan> spans;
  st.add_spans(a0, a1, spans);
  spans.push_back({st.k(0), st.v(0), 0});  // an empty span changes nothing
  st.add_spans(b0, b1, spans);
  const std::vector<double> ref = reference(st, q, c.heads, scale, a0, a1, b0, b1);
  for (PagedIsa isa : available_isas()) {
    std::vector<float> out(q.size(), NAN);
    PagedDecodeJob job;
    job.q = q.data();
    job.out = out.data();
    job.heads = c.heads;
    job.head_dim = static_cast<int32_t>(c.d);
    job.elem = type;
    job.scale = scale;
    job.spans = spans;
    paged_decode(job, isa);
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double e = std::abs(out[i] - ref[i]);
      if (!(e <= worst)) {
        worst = e;
        at = i;
      }
    }
    EXPECT_LE(worst, tol) << paged_isa_name(isa) << " " << dtype_name(type) << " d " << c.d << " heads "
                          << c.heads << " block " << c.block << " len " << c.len << " sink " << c.sink
                          << " window " << c.window << " kscale " << c.kscale << ": element " << at << " "
                          << out[at] << " vs " << ref[at];
  }
}

// A split walk: the case's keys (the two ranges one after the other) cut at `cuts` (indices into that list,
// ascending; a cut may repeat: an empty part), each part run alone with its running max and sum kept, then
// paged_decode_merge; on every path, against the unsplit result of the same path (only the order of the f32 sums
// differs: 2e-6 relative to the largest output) and the f64 reference (`tol`).
void check_split(const Case& c, DType type, uint32_t seed, const std::vector<int64_t>& cuts, double tol = 3e-5) {
  std::mt19937 rng(seed);
  const Store st(c.d, c.block, type, c.len, rng, c.kscale);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(c.heads * c.d));
  for (float& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  int64_t a0 = 0, a1 = c.len, b0 = c.len, b1 = c.len;
  if (c.sink >= 0) {
    a1 = std::min(c.sink, c.len);
    b0 = std::max(a1, c.len - c.window);
  }
  const int64_t na = a1 - a0, n = na + (b1 - b0);
  std::vector<int64_t> bounds{0};
  for (int64_t x : cuts) bounds.push_back(std::min(x, n));
  bounds.push_back(n);
  const auto parts = static_cast<int32_t>(bounds.size() - 1);
  const std::vector<double> ref = reference(st, q, c.heads, scale, a0, a1, b0, b1);
  const size_t hd = q.size();
  for (PagedIsa isa : available_isas()) {
    PagedDecodeJob job;
    job.q = q.data();
    job.heads = c.heads;
    job.head_dim = static_cast<int32_t>(c.d);
    job.elem = type;
    job.scale = scale;
    std::vector<KeySpan> spans;
    st.add_spans(a0, a1, spans);
    st.add_spans(b0, b1, spans);
    std::vector<float> whole(hd, NAN);
    job.out = whole.data();
    job.spans = spans;
    paged_decode(job, isa);
    std::vector<float> outs(static_cast<size_t>(parts) * hd, NAN), maxes(static_cast<size_t>(parts * c.heads), NAN),
        sums(maxes.size(), NAN);
    for (int32_t p = 0; p < parts; ++p) {
      const int64_t c0 = bounds[static_cast<size_t>(p)], c1 = bounds[static_cast<size_t>(p) + 1];
      spans.clear();
      st.add_spans(a0 + std::min(c0, na), a0 + std::min(c1, na), spans);
      st.add_spans(b0 + std::max(c0, na) - na, b0 + std::max(c1, na) - na, spans);
      job.out = outs.data() + static_cast<size_t>(p) * hd;
      job.part_max = maxes.data() + p * c.heads;
      job.part_sum = sums.data() + p * c.heads;
      job.spans = spans;
      paged_decode(job, isa);
      if (c1 == c0)
        for (int g = 0; g < c.heads; ++g) {
          ASSERT_EQ(maxes[static_cast<size_t>(p * c.heads + g)], -INFINITY) << "an empty part's maximum";
          ASSERT_EQ(sums[static_cast<size_t>(p * c.heads + g)], 0.0f) << "an empty part's sum";
        }
    }
    std::vector<float> merged(hd, NAN);
    paged_decode_merge(outs.data(), maxes.data(), sums.data(), parts, c.heads, static_cast<int32_t>(c.d),
                       merged.data());
    double largest = 0, worst_whole = 0, worst_ref = 0;
    size_t at = 0;
    for (size_t i = 0; i < hd; ++i) {
      largest = std::max(largest, std::abs(ref[i]));
      worst_whole = std::max(worst_whole, static_cast<double>(std::abs(merged[i] - whole[i])));
      const double e = std::abs(merged[i] - ref[i]);
      if (!(e <= worst_ref)) {
        worst_ref = e;
        at = i;
      }
    }
    const std::string what = std::string(paged_isa_name(isa)) + " " + std::string(dtype_name(type)) + " d " +
                             std::to_string(c.d) + " heads " + std::to_string(c.heads) + " block " +
                             std::to_string(c.block) + " len " + std::to_string(c.len) + " sink " +
                             std::to_string(c.sink) + " window " + std::to_string(c.window) + " parts " +
                             std::to_string(parts);
    EXPECT_LE(worst_ref, tol) << what << ": element " << at << " " << merged[at] << " vs " << ref[at];
    EXPECT_LE(worst_whole, 2e-6 * std::max(1.0, largest)) << what << " (against the unsplit walk)";
  }
}

TEST(PagedDecode, PathsAvailable) {
  EXPECT_TRUE(paged_decode_isa_available(PagedIsa::Portable));
  EXPECT_EQ(paged_decode_isa_available(PagedIsa::Avx512),
            cpu_detail::paged_decode_avx512_built() && cpu_has_avx512());
  EXPECT_TRUE(paged_decode_isa_available(paged_decode_isa()));
  EXPECT_EQ(paged_isa_name(PagedIsa::Portable), "portable");
  EXPECT_EQ(paged_isa_name(PagedIsa::Avx2), "avx2");
  EXPECT_EQ(paged_isa_name(PagedIsa::Avx512), "avx512");
#if defined(__x86_64__)
  // The build's baseline is x86-64-v3 (AVX2, FMA, F16C): its AVX2 path is always there.
  EXPECT_TRUE(paged_decode_isa_available(PagedIsa::Avx2));
#endif
}

TEST(PagedDecode, EveryTypeHeadDimAndGroupAgainstF64Reference) {
  uint32_t seed = 1;
  for (DType type : {DType::F32, DType::BF16, DType::F16})
    for (int64_t d : {64, 128, 256})
      for (int heads : {1, 2, 3, 4, 5, 6, 7, 8, 11})
        check_case({d, heads, 64, d == 64 ? 333 : 150}, type, seed++);
}

TEST(PagedDecode, KeyCountsAroundTheEdges) {
  uint32_t seed = 100;
  // 1..17 keys (within one 16-key group and past it), the 64-key chunk's edges, lengths not a multiple of a
  // block.
  for (DType type : {DType::F32, DType::F16})
    for (int64_t len : {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 200})
      for (int heads : {1, 3, 4}) check_case({64, heads, 64, len}, type, seed++);
  for (int64_t len : {1, 9, 17, 100}) check_case({256, 4, 64, len}, DType::BF16, seed++);
}

TEST(PagedDecode, BlockSizesAndMoaViews) {
  uint32_t seed = 200;
  for (DType type : {DType::F32, DType::BF16, DType::F16})
    for (int64_t block : {1, 7, 16, 64, 100, 256}) {
      check_case({64, 3, block, 301}, type, seed++);
      check_case({128, 2, block, 301, 4, 77}, type, seed++);    // sink 4 + the last 77 keys
      check_case({64, 1, block, 301, 0, 5}, type, seed++);      // a window only
      check_case({64, 3, block, 301, 40, 1000}, type, seed++);  // the window covers it all: one range
    }
}

TEST(PagedDecode, HeadDimsTheWidePathsLeaveToNarrowerOnes) {
  uint32_t seed = 300;
  // 8, 24, 40, 72: AVX2 takes them (not AVX-512); 4, 20, 33: the portable twin.
  for (DType type : {DType::F32, DType::F16})
    for (int64_t d : {4, 8, 20, 24, 33, 40, 72})
      for (int heads : {1, 3, 8}) check_case({d, heads, 16, 90}, type, seed++);
}

TEST(PagedDecode, LargeScoresRescaleAcrossChunks) {
  uint32_t seed = 400;
  // Keys with a spread of 8 and 30: scores of tens to hundreds, the running maximum moving from chunk to
  // chunk (weights underflowing to 0 on the way), relative to the largest output.
  for (DType type : {DType::F32, DType::BF16, DType::F16})
    for (float kscale : {8.0f, 30.0f}) {
      check_case({64, 3, 64, 500, -1, 0, kscale}, type, seed++, 1e-4);
      check_case({256, 4, 16, 300, -1, 0, kscale}, type, seed++, 1e-4);
    }
}

TEST(PagedDecode, SplitWalksMergeToTheUnsplitOne) {
  uint32_t seed = 500;
  // Every type, head dim and group: two and three parts, cut at a block edge (64) and mid-block; the length not a
  // multiple of the block.
  for (DType type : {DType::F32, DType::BF16, DType::F16})
    for (int64_t d : {64, 128, 256})
      for (int heads : {1, 2, 3, 4, 5, 6, 7, 8}) {
        check_split({d, heads, 64, 301}, type, seed++, {128});
        check_split({d, heads, 64, 301}, type, seed++, {37, 200});
      }
  // Many parts, some of one key, an empty one, one past the end (empty); blocks of 7 and 100.
  for (DType type : {DType::F32, DType::F16}) {
    check_split({64, 3, 7, 250}, type, seed++, {1, 2, 2, 16, 17, 100, 249, 400});
    check_split({256, 4, 100, 333}, type, seed++, {100, 101, 116, 300});
  }
}

TEST(PagedDecode, SplitMoaViewsAndLargeScores) {
  uint32_t seed = 600;
  for (DType type : {DType::F32, DType::BF16, DType::F16})
    for (int64_t block : {16, 64, 100}) {
      // Sink 4 + the last 77 keys: cuts inside the sink, at its end, inside the window.
      check_split({128, 2, block, 301, 4, 77}, type, seed++, {2, 40});
      check_split({128, 2, block, 301, 4, 77}, type, seed++, {4});
      check_split({64, 5, block, 301, 30, 50}, type, seed++, {10, 30, 31, 64});
      check_split({64, 1, block, 301, 0, 5}, type, seed++, {3});  // a window only
    }
  // The parts' maxima far apart (a part's weights underflow next to another's).
  for (DType type : {DType::F32, DType::BF16, DType::F16})
    for (float kscale : {8.0f, 30.0f}) {
      check_split({64, 3, 64, 500, -1, 0, kscale}, type, seed++, {64, 250, 251}, 1e-4);
      check_split({256, 4, 16, 300, -1, 0, kscale}, type, seed++, {150}, 1e-4);
    }
}

TEST(PagedDecode, MergeOfEmptyPartsAndBadArguments) {
  // No part saw a key: zeros; a part with a key among empty ones: its own normalised output.
  const std::vector<float> outs{0, 0, 0, 0, 6, -3, 0, 0}, maxes{-INFINITY, -INFINITY, 2.5f, -INFINITY},
      sums{0, 0, 3, 0};
  std::vector<float> out(4, NAN);
  paged_decode_merge(outs.data(), maxes.data(), sums.data(), 2, 2, 2, out.data());
  EXPECT_EQ(out, (std::vector<float>{2, -1, 0, 0}));
  try {
    paged_decode_merge(outs.data(), maxes.data(), sums.data(), 0, 2, 2, out.data());
    ADD_FAILURE() << "no parts";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "paged decode merge: 0 parts of 2 heads of dimension 2");
  }
  std::vector<float> q(64, 1.0f), o(64), m(1);
  PagedDecodeJob job;
  job.q = q.data();
  job.out = o.data();
  job.head_dim = 64;
  job.part_max = m.data();
  try {
    paged_decode(job, PagedIsa::Portable);
    ADD_FAILURE() << "a maximum without a sum";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "paged decode attention: a part's running maxima without its sums (or the other way)");
  }
}

TEST(PagedDecode, PartsFollowTheThreadsAndTheMinimum) {
  const int64_t was = paged_split_min_work();
  EXPECT_EQ(was, kPagedSplitMinWork);
  const int64_t m = kPagedSplitMinWork;
  // A long item (Gemma-3's one KV head after 8K: 8192 keys x 4 heads x 256): 2 parts per thread.
  EXPECT_EQ(paged_decode_parts(8192 * 4 * 256, 2), 4);
  EXPECT_EQ(paged_decode_parts(100 * m, 8), 16);
  // Shorter: as many parts of the minimum as it holds.
  EXPECT_EQ(paged_decode_parts(3 * m, 2), 3);
  EXPECT_EQ(paged_decode_parts(3 * m - 1, 2), 2);
  EXPECT_EQ(paged_decode_parts(2 * m - 1, 2), 1);  // too short to split
  EXPECT_EQ(paged_decode_parts(0, 2), 1);
  EXPECT_EQ(paged_decode_parts(100 * m, 1), 1);  // one thread: never
  set_paged_split_min_work(0);                   // off
  EXPECT_EQ(paged_decode_parts(100 * m, 2), 1);
  set_paged_split_min_work(1);
  EXPECT_EQ(paged_decode_parts(5, 3), 5);
  EXPECT_EQ(paged_decode_parts(1000, 3), 6);
  set_paged_split_min_work(was);
}

TEST(PagedDecode, NoKeysGivesZerosAndBadJobsAreRefused) {
  std::vector<float> q(3 * 64, 1.0f), out(q.size(), NAN);
  PagedDecodeJob job;
  job.q = q.data();
  job.out = out.data();
  job.heads = 3;
  job.head_dim = 64;
  job.elem = DType::F16;
  for (PagedIsa isa : available_isas()) {
    std::fill(out.begin(), out.end(), NAN);
    paged_decode(job, isa);
    for (float x : out) ASSERT_EQ(x, 0.0f) << paged_isa_name(isa);
  }
  job.elem = DType::I32;
  try {
    paged_decode(job, PagedIsa::Portable);
    ADD_FAILURE() << "i32 keys";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "paged decode attention: keys and values in i32 (expected f32, bf16 or f16)");
  }
  job.elem = DType::F32;
  job.heads = 0;
  try {
    paged_decode(job, PagedIsa::Portable);
    ADD_FAILURE() << "no heads";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "paged decode attention: 0 heads of dimension 64");
  }
  if (!paged_decode_isa_available(PagedIsa::Avx512)) {
    job.heads = 3;
    try {
      paged_decode(job, PagedIsa::Avx512);
      ADD_FAILURE() << "avx512 on a CPU without it";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "paged decode attention: this CPU or build has no avx512 path");
    }
  }
}

}  // namespace
}  // namespace tessera::attn

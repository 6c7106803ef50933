// Tokenizer from a Hugging Face tokenizer.json (+ tokenizer_config.json): byte-level BPE models.
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "model/tokenizer/pretokenizer.h"
#include "model/tokenizer/tokenizer.h"

namespace tessera::model {

namespace {

using nlohmann::json;

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") ? j["type"].get<std::string>() : "";
}

void add_pre_tokenizer(const json& p, std::vector<PreTokenizerStep>& steps, bool& byte_level) {
  if (p.is_null()) return;
  const std::string type = type_of(p);
  using B = PreTokenizerStep::Behavior;
  if (type == "Sequence") {
    for (const auto& child : p.at("pretokenizers")) add_pre_tokenizer(child, steps, byte_level);
  } else if (type == "ByteLevel") {
    byte_level = true;
    if (p.value("add_prefix_space", false)) steps.push_back({"", B::Isolated, false, true});
    if (p.value("use_regex", true)) {
      for (auto& s : named_pre_tokenizer("gpt2")) steps.push_back(std::move(s));
    }
  } else if (type == "Digits") {
    steps.push_back({p.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)"});
  } else if (type == "Split") {
    PreTokenizerStep s;
    const json& pattern = p.at("pattern");
    if (pattern.contains("Regex")) {
      s.pattern = pattern["Regex"].get<std::string>();
    } else if (pattern.contains("String")) {
      s.pattern = "\\Q" + pattern["String"].get<std::string>() + "\\E";
    } else {
      throw Error("tokenizer.json: Split pre-tokenizer without a Regex or String pattern");
    }
    const std::string behavior = p.value("behavior", "Isolated");
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
    s.invert = p.value("invert", false);
    steps.push_back(std::move(s));
  } else {
    throw Error("tokenizer.json: pre-tokenizer \"" + type +
                "\" is not supported (tessera reads Sequence, ByteLevel, Split, Digits)");
  }
}

Normalizer read_normalizer(const json& n) {
  if (n.is_null()) return Normalizer::None;
  const std::string type = type_of(n);
  if (type == "NFC") return Normalizer::NFC;
  if (type == "Sequence" && n.value("normalizers", json::array()).empty()) return Normalizer::None;
  if (type == "Sequence" && n["normalizers"].size() == 1) return read_normalizer(n["normalizers"][0]);
  throw Error("tokenizer.json: normalizer \"" + type + "\" is not supported (tessera reads none and NFC)");
}

// A token named in tokenizer_config.json: a string, or an AddedToken object with "content".
std::string config_token(const json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content")) return (*it)["content"].get<std::string>();
  return {};
}

}  // namespace

TokenizerData Tokenizer::hf_json_data(const json& tj, const json& config) {
  TokenizerData d;
  d.kind = TokenizerKind::ByteLevelBPE;
  d.pre_tokenizer_name = "tokenizer.json";
  const json& model = tj.at("model");
  const std::string mtype = model.value("type", "BPE");
  if (mtype != "BPE")
    throw Error("tokenizer.json: model type \"" + mtype + "\" is not supported (tessera reads BPE)");

  // Vocabulary: model.vocab plus added_tokens (whose ids may lie past it).
  const json& vocab = model.at("vocab");
  size_t n = 0;
  for (const auto& [text, id] : vocab.items()) n = std::max(n, id.get<size_t>() + 1);
  const json added = tj.value("added_tokens", json::array());
  for (const auto& a : added) n = std::max(n, a.at("id").get<size_t>() + 1);
  d.tokens.assign(n, std::string());
  d.types.assign(n, TokenType::Unused);
  for (const auto& [text, id] : vocab.items()) {
    d.tokens[id.get<size_t>()] = text;
    d.types[id.get<size_t>()] = TokenType::Normal;
  }
  for (const auto& a : added) {
    const auto id = a.at("id").get<int32_t>();
    d.tokens[id] = a.at("content").get<std::string>();
    d.types[id] = a.value("special", false) ? TokenType::Control : TokenType::UserDefined;
    if (a.value("lstrip", false)) d.lstrip_tokens.push_back(id);
    if (a.value("rstrip", false)) d.rstrip_tokens.push_back(id);
  }

  for (const auto& m : model.value("merges", json::array())) {
    if (m.is_string()) {
      const std::string text = m.get<std::string>();
      const size_t space = text.find(' ', 1);
      if (space == std::string::npos) throw Error("tokenizer.json: merge \"" + text + "\" is not \"a b\"");
      d.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (m.is_array() && m.size() == 2) {
      d.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      throw Error("tokenizer.json: a merge is neither \"a b\" nor [\"a\", \"b\"]");
    }
  }
  d.ignore_merges = model.value("ignore_merges", false);
  if (model.value("byte_fallback", false)) {
    throw Error(
        "tokenizer.json: byte_fallback BPE (SentencePiece-style) is read from GGUF files only for now");
  }

  d.normalizer = read_normalizer(tj.value("normalizer", json()));
  bool byte_level = false;
  add_pre_tokenizer(tj.value("pre_tokenizer", json()), d.pre_tokenizer, byte_level);
  if (!byte_level && type_of(tj.value("decoder", json())) != "ByteLevel") {
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
  std::vector<json> procs;
  if (type_of(post) == "Sequence") {
    for (const auto& p : post.at("processors")) procs.push_back(p);
  } else if (!post.is_null()) {
    procs.push_back(post);
  }
  for (const auto& p : procs) {
    if (type_of(p) != "TemplateProcessing") continue;
    const json& single = p.at("single");
    for (size_t i = 0; i < single.size(); ++i) {
      if (!single[i].contains("SpecialToken")) continue;
      const int32_t id = id_of(single[i]["SpecialToken"].at("id").get<std::string>());
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
  return std::make_unique<Tokenizer>(hf_json_data(tokenizer_json, tokenizer_config));
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
  } catch (const json::exception& e) {
    throw Error(path + ": unexpected tokenizer.json layout (" + e.what() + ")");
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace tessera::model

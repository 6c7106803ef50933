// `tessera inspect`: what a model file holds — configuration, tensors by type, tokenizer, chat format.
#include <cstdio>
#include <map>

#include "cli/commands.h"
#include "cli/session.h"

namespace tessera::cli {

int inspect_command(const InspectOptions& o) {
  const Session s = Session::open(o.model);
  const model::ModelFile& f = s.model->file();
  const auto& c = s.model->config();
  std::printf("file: %s (%s%s)\n", f.path().c_str(), f.format() == model::FileFormat::GGUF ? "GGUF v" : "safetensors",
              f.format() == model::FileFormat::GGUF ? std::to_string(f.gguf_version()).c_str() : "");
  std::printf("%s\n", c.summary().c_str());
  std::map<std::string, std::pair<int, int64_t>> by_type;
  int64_t params = 0;
  for (const auto& t : f.tensors()) {
    auto& e = by_type[std::string(model::tensor_type_name(t.type))];
    ++e.first;
    e.second += t.numel();
    params += t.numel();
  }
  std::printf("tensors: %zu, %s parameters;", f.tensors().size(), with_commas(params).c_str());
  for (const auto& [type, e] : by_type) std::printf(" %s x%d", type.c_str(), e.first);
  std::printf("\n");
  // What the CPU keeps in memory: each group's type and bytes (model/weights.h).
  std::printf("weights kept: %s\n", s.model->weights().summary().c_str());
  const auto& tok = *s.tokenizer;
  const auto& sp = tok.special();
  auto name = [&](int32_t id) {
    std::string out = "-";
    if (id >= 0) out.assign(tok.token_text(id)).append(" (").append(std::to_string(id)).append(")");
    return out;
  };
  std::printf("tokenizer: %s, %s tokens, pre-tokenizer '%s'; bos %s, eos %s, eot %s; add_bos %s\n",
              tok.kind() == model::TokenizerKind::ByteLevelBPE ? "byte-level BPE" : "SentencePiece BPE",
              with_commas(tok.vocab_size()).c_str(), tok.pre_tokenizer_name().c_str(), name(sp.bos).c_str(),
              name(sp.eos).c_str(), name(sp.eot).c_str(), sp.add_bos ? "yes" : "no");
  if (s.chat)
    std::printf("chat format: %s (from the model's chat template)\n", std::string(model::chat_family_name(s.chat->family())).c_str());
  else
    std::printf("chat format: none (%s)\n", s.no_chat_reason.c_str());
  if (o.metadata) {
    for (const auto& [key, value] : f.metadata().items()) {
      std::string v;
      if (value.is_array()) {
        v.append("[").append(std::to_string(value.size())).append(" items]");
      } else {
        v = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      }
      if (v.size() > 120) v = v.substr(0, 117) + "...";
      std::printf("  %s = %s\n", key.c_str(), v.c_str());
    }
  }
  if (o.tensors) {
    for (const auto& t : f.tensors()) {
      std::printf("  %-48s %-6s %s\n", t.name.c_str(), std::string(model::tensor_type_name(t.type)).c_str(),
                  t.shape_string().c_str());
    }
  }
  return 0;
}

}  // namespace tessera::cli

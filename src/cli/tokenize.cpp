// `tessera tokenize`: a text's token ids, as `tessera run` prefills them (the same encode_prompt: plain text with
// the tokenizer's BOS, or --chat's template), without loading the weights.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/session.h"

namespace tessera::cli {

int tokenize_command(const TokenizeOptions& o) {
  check_tokenize_options(o);
  const std::string text = read_prompt(o.prompt, o.prompt_file);
  const Session s = Session::open_tokenizer(o.model);
  std::vector<int32_t> ids;
  if (o.chat) {
    ids = s.encode_prompt(text, /*chat_mode=*/true, o.system);
  } else {
    ids = s.tokenizer->encode(text, {.add_special = !o.no_special, .parse_special = o.parse_special});
  }
  if (o.ids) {
    std::string line = "[";
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? ", " : "") + std::to_string(ids[i]);
    std::printf("%s]\n", line.c_str());
    return 0;
  }
  // Each token's bytes (special tokens as their text); a piece may hold part of a UTF-8 character.
  std::vector<std::string> pieces;
  pieces.reserve(ids.size());
  for (const int32_t id : ids) pieces.push_back(s.tokenizer->token_to_piece(id, /*render_special=*/true));
  if (o.json) {
    const nlohmann::json j = {{"tokens", ids}, {"pieces", pieces}, {"count", ids.size()}};
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  // One line per token: the id, then the piece as a JSON string (escapes for newlines, quotes and bytes that are
  // not UTF-8 on their own).
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string piece = nlohmann::json(pieces[i]).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::printf("%d\t%s\n", ids[i], piece.c_str());
  }
  return 0;
}

}  // namespace tessera::cli

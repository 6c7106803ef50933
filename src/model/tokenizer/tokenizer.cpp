#include "model/tokenizer/tokenizer.h"

#include <algorithm>
#include <optional>
#include <unordered_map>

#include "core/error.h"
#include "model/tokenizer/bpe.h"
#include "model/tokenizer/byte_level.h"
#include "model/tokenizer/pretokenizer.h"
#include "model/tokenizer/sentencepiece.h"
#include "model/tokenizer/special_tokens.h"
#include "model/tokenizer/unicode_nfc.h"
#include "model/tokenizer/utf8.h"

namespace tessera::model {

struct Tokenizer::Impl {
  TokenizerData d;
  std::unordered_map<std::string, int32_t> ids;  // spelling -> id (first id wins for duplicates)
  std::optional<SpecialTokenMatcher> specials;
  std::optional<PreTokenizer> pre;
  std::optional<ByteLevelBpe> bpe;
  std::optional<SentencePieceBpe> spm;
  size_t longest_special = 0;     // bytes of the longest token the special matcher looks for
  std::vector<uint8_t> rstrip;    // by id: the token takes the spaces after it
  bool plain_cuts = false;        // encode() may resume inside plain text (cut_plain)

  explicit Impl(TokenizerData data) : d(std::move(data)) {
    const size_t n = d.tokens.size();
    check(n > 0, "tokenizer: the vocabulary is empty");
    check(d.types.empty() || d.types.size() == n, "tokenizer: " + std::to_string(d.types.size()) +
                                                      " token types for " + std::to_string(n) + " tokens");
    check(d.scores.empty() || d.scores.size() == n,
          "tokenizer: " + std::to_string(d.scores.size()) + " scores for " + std::to_string(n) + " tokens");
    if (d.types.empty()) d.types.assign(n, TokenType::Normal);
    const auto in_range = [n](int32_t id) { return id >= -1 && id < static_cast<int32_t>(n); };
    const SpecialTokens& s = d.special;
    check(in_range(s.bos) && in_range(s.eos) && in_range(s.eot) && in_range(s.pad) && in_range(s.unk),
          "tokenizer: a special token id is outside the vocabulary of " + std::to_string(n) + " tokens");
    for (int32_t id : s.end_of_generation)
      check(in_range(id) && id >= 0, "tokenizer: bad end-of-generation id");
    ids.reserve(n);
    for (size_t i = 0; i < n; ++i) ids.try_emplace(d.tokens[i], static_cast<int32_t>(i));
    specials.emplace(d.tokens, d.types, d.lstrip_tokens, d.rstrip_tokens);
    if (d.kind == TokenizerKind::ByteLevelBPE) {
      pre.emplace(d.pre_tokenizer);
      bpe.emplace(ids, d.merges, d.ignore_merges);
    } else {
      spm.emplace(d.tokens, d.types, d.scores, d.byte_fallback, d.special.unk);
    }
    for (size_t i = 0; i < n; ++i) {
      const TokenType t = d.types[i];
      if (t == TokenType::Control || t == TokenType::Unknown || t == TokenType::UserDefined)
        longest_special = std::max(longest_special, d.tokens[i].size());
    }
    rstrip.assign(n, 0);
    for (int32_t id : d.rstrip_tokens)
      if (id >= 0 && static_cast<size_t>(id) < n) rstrip[id] = 1;
    plain_cuts = d.normalizer == Normalizer::None &&
                 (d.kind == TokenizerKind::SentencePieceBPE ? spm->parts_independent() : known_pre_tokenizer(d.pre_tokenizer));
  }

  // Whether `steps` are one of the named pre-tokenizers, whose regexes cut_plain's rule is written for.
  static bool known_pre_tokenizer(const std::vector<PreTokenizerStep>& steps) {
    const auto same = [](const PreTokenizerStep& a, const PreTokenizerStep& b) {
      return a.pattern == b.pattern && a.behavior == b.behavior && a.invert == b.invert &&
             a.prefix_space == b.prefix_space;
    };
    for (const char* name : {"gpt2", "llama3", "qwen2", "smollm"}) {
      const std::vector<PreTokenizerStep> known = named_pre_tokenizer(name);
      if (known.size() == steps.size() && std::equal(known.begin(), known.end(), steps.begin(), same)) return true;
    }
    return false;
  }

  bool special(int32_t id) const {
    const TokenType t = d.types[id];
    return t == TokenType::Control || t == TokenType::Unknown;
  }

  void check_id(int32_t id) const {
    if (id < 0 || id >= static_cast<int32_t>(d.tokens.size())) {
      throw Error("tokenizer: token id " + std::to_string(id) + " is outside the vocabulary of " +
                  std::to_string(d.tokens.size()) + " tokens");
    }
  }

  std::string piece(int32_t id, bool render_special) const {
    check_id(id);
    const std::string& text = d.tokens[id];
    const TokenType t = d.types[id];
    if (t == TokenType::Control || t == TokenType::Unknown) return render_special ? text : std::string();
    if (d.kind == TokenizerKind::ByteLevelBPE) {
      return t == TokenType::UserDefined ? text : byte_level::unspell(text);
    }
    // (not std::stoi, which throws std::invalid_argument for "<0xZZ>" and reads "<0x-1>")
    if (const int byte = byte_token_value(text); t == TokenType::Byte && byte >= 0) {
      return std::string(1, static_cast<char>(byte));
    }
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size(); ++i) {
      if (text.compare(i, 3, "\xE2\x96\x81") == 0) {
        out += ' ';
        i += 2;
      } else {
        out += text[i];
      }
    }
    return out;
  }

  // `prefix`: SentencePiece adds its prefix space here (when the model has one).
  void encode_plain(std::string_view text, bool prefix, std::vector<int32_t>& out) const {
    std::string normalized;
    if (d.normalizer == Normalizer::NFC) {
      normalized = unicode::nfc(text);
      text = normalized;
    }
    if (d.kind == TokenizerKind::ByteLevelBPE) {
      if (pre->empty()) {
        bpe->encode_piece(text, out);
        return;
      }
      for (const std::string& piece : pre->split(text)) bpe->encode_piece(piece, out);
      return;
    }
    std::string escaped = (d.add_space_prefix && prefix) ? escape_spaces(" ") : std::string();
    escaped += escape_spaces(text);
    spm->encode(escaped, out);
  }

  // Whether encoding may resume at text[c] (a space) inside plain text. Both families: the byte before is printable
  // ASCII other than a space, so no regex match of the named pre-tokenizers spans c or looks past it (their
  // matches of letters, digits and punctuation end at a space, their whitespace runs end before text[c - 1]), and
  // the special-token matcher's lstrip cannot reach back over it; SentencePiece also cuts its merges there
  // (sentencepiece.h). Without a normalizer only (NFC may compose across a cut).
  bool cut_plain(std::string_view text, size_t c) const {
    if (text[c] != ' ') return false;
    const auto before = static_cast<unsigned char>(text[c - 1]);
    if (before < 0x21 || before > 0x7E) return false;
    return d.kind != TokenizerKind::SentencePieceBPE || spm->cuts_before_space(text.substr(c - 1, 1));
  }

  // Encodes text[pos, end) as encode() does after text[0, pos) left `prefix_pending`, appending to `out`; records
  // checkpoints past pos (after every special token, and at plain cuts at least `spacing` bytes apart, or within the
  // last `spacing` bytes of the text, where the next text that extends this one will look) when asked.
  void encode_rest(std::string_view text, size_t pos, bool prefix_pending, bool parse_special,
                   std::vector<int32_t>& out, std::vector<EncodeCheckpoint>* checkpoints, size_t spacing) const {
    size_t last = pos;  // the last checkpoint's text position
    const size_t reach = std::max<size_t>(1, longest_special);  // what the matcher reads from a position on
    // SentencePiece's prefix space goes in front of the text, as SentencePiece writes it: a user-defined token
    // is part of the text (a leading one gets a lone "▁" before it), a control token ends it (text after one
    // gets its own prefix space, as llama.cpp does).
    for (const Fragment& f : specials->split(text.substr(pos), parse_special)) {
      if (f.token >= 0) {
        if (prefix_pending && d.types[f.token] == TokenType::UserDefined) {
          encode_plain("", true, out);
          prefix_pending = false;
        } else if (d.types[f.token] != TokenType::UserDefined) {
          prefix_pending = true;
        }
        out.push_back(f.token);
        if (checkpoints != nullptr) {
          const size_t at = pos + f.at, next = pos + f.next;
          checkpoints->push_back({next, out.size(), std::max(at + reach, rstrip[f.token] ? next + 1 : next),
                                  prefix_pending});
          last = next;
        }
        continue;
      }
      const size_t begin = pos + f.at, end = pos + f.next;
      size_t part = begin;
      if (checkpoints != nullptr && plain_cuts) {
        for (size_t c = begin + 1; c < end; ++c) {
          if ((c < last + spacing && c + spacing < text.size()) || !cut_plain(text, c)) continue;
          encode_plain(text.substr(part, c - part), prefix_pending && part == begin, out);
          checkpoints->push_back({c, out.size(), c + reach, false});
          last = part = c;
        }
      }
      encode_plain(text.substr(part, end - part), prefix_pending && part == begin, out);
      prefix_pending = false;
    }
  }
};

Tokenizer::Tokenizer(TokenizerData data) : impl_(std::make_unique<Impl>(std::move(data))) {}
Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  return encode(text, options, nullptr);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& options,
                                       std::vector<EncodeCheckpoint>* checkpoints, size_t spacing) const {
  const Impl& m = *impl_;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (options.add_special && m.d.special.add_bos && m.d.special.bos >= 0) out.push_back(m.d.special.bos);
  m.encode_rest(text, 0, true, options.parse_special, out, checkpoints, spacing);
  if (options.add_special && m.d.special.add_eos && m.d.special.eos >= 0) out.push_back(m.d.special.eos);
  return out;
}

std::vector<int32_t> Tokenizer::encode_from(std::string_view text, const EncodeOptions& options,
                                            std::span<const int32_t> before, const EncodeCheckpoint& from,
                                            std::vector<EncodeCheckpoint>* checkpoints, size_t spacing) const {
  const Impl& m = *impl_;
  check(from.ids <= before.size() && from.text_pos <= from.needs && from.needs <= text.size(),
        "tokenizer: encode_from's checkpoint (byte " + std::to_string(from.text_pos) + ", " +
            std::to_string(from.ids) + " ids, needs " + std::to_string(from.needs) + " bytes) does not fit " +
            std::to_string(before.size()) + " ids and a text of " + std::to_string(text.size()) + " bytes");
  std::vector<int32_t> out;
  out.reserve(from.ids + (text.size() - from.text_pos) / 3 + 4);
  out.assign(before.begin(), before.begin() + static_cast<std::ptrdiff_t>(from.ids));
  m.encode_rest(text, from.text_pos, from.prefix_pending, options.parse_special, out, checkpoints, spacing);
  if (options.add_special && m.d.special.add_eos && m.d.special.eos >= 0) out.push_back(m.d.special.eos);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, const DecodeOptions& options) const {
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    std::string p = impl_->piece(id, !options.skip_special);
    // SentencePiece with a prefix space: the space encode() put in front of the text is not part of it.
    if (first && !impl_->special(id) && !p.empty()) {
      if (impl_->d.add_space_prefix && impl_->d.kind == TokenizerKind::SentencePieceBPE && p[0] == ' ')
        p.erase(0, 1);
      first = false;
    }
    out += p;
  }
  return out;
}

std::string Tokenizer::token_to_piece(int32_t id, bool render_special) const {
  return impl_->piece(id, render_special);
}

const std::string& Tokenizer::token_text(int32_t id) const {
  impl_->check_id(id);
  return impl_->d.tokens[id];
}

TokenType Tokenizer::token_type(int32_t id) const {
  impl_->check_id(id);
  return impl_->d.types[id];
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  const auto it = impl_->ids.find(std::string(text));
  if (it == impl_->ids.end()) return std::nullopt;
  return it->second;
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->d.tokens.size());
}
TokenizerKind Tokenizer::kind() const {
  return impl_->d.kind;
}
const std::string& Tokenizer::pre_tokenizer_name() const {
  return impl_->d.pre_tokenizer_name;
}
bool Tokenizer::add_space_prefix() const {
  return impl_->d.add_space_prefix;
}
const SpecialTokens& Tokenizer::special() const {
  return impl_->d.special;
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  const auto& eog = impl_->d.special.end_of_generation;
  return std::find(eog.begin(), eog.end(), id) != eog.end();
}

bool Tokenizer::is_special(int32_t id) const {
  impl_->check_id(id);
  return impl_->special(id);
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  if (impl_->pre) return impl_->pre->split(text);
  return {std::string(text)};
}

std::string StreamingDecoder::push(int32_t id) {
  std::string p = tokenizer_.token_to_piece(id, !options_.skip_special);
  if (first_ && !tokenizer_.is_special(id) && !p.empty()) {
    if (tokenizer_.add_space_prefix() && tokenizer_.kind() == TokenizerKind::SentencePieceBPE &&
        p[0] == ' ') {
      p.erase(0, 1);
    }
    first_ = false;
  }
  if (p.empty()) return {};
  pending_ += p;
  const size_t n = utf8::complete_prefix_length(pending_);
  std::string out = utf8::sanitize(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string StreamingDecoder::flush() {
  std::string out = utf8::sanitize(pending_);
  pending_.clear();
  first_ = true;
  return out;
}

}  // namespace tessera::model

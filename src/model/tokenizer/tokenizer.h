// tessera/model/tokenizer/tokenizer.h — text <-> token ids for the models tessera serves.
//
//   auto tok = tessera::model::Tokenizer::from_gguf(model_file->metadata());   // or
//   from_hf_file("tokenizer.json") std::vector<int32_t> ids = tok->encode("Hello", {.add_special = true,
//   .parse_special = false}); std::string text = tok->decode(ids);
//
// Two tokenizer models cover the supported families (see docs/tokenizers.md):
// - ByteLevelBPE: GPT-2 style byte-level BPE with ranked merges and a regex pre-tokenizer (GPT-2, Llama-3,
// Qwen2,
//   SmolLM2). GGUF tokenizer.ggml.model "gpt2", or a Hugging Face tokenizer.json whose model is BPE.
// - SentencePieceBPE: SentencePiece BPE with scores: spaces become U+2581, the adjacent pair whose merged
// piece
//   scores highest merges first, characters with no piece fall back to <0xXX> byte tokens (Llama-2, Mistral,
//   Gemma-3). GGUF tokenizer.ggml.model "llama".
//
// Contract
// - Ids are int32 in [0, vocab_size()). Text is UTF-8 on input; encode() accepts any bytes (an invalid byte
// is
//   its own pre-token, then tokenized by byte), decode() returns the exact bytes the tokens stand for, which
//   may end inside a character when the ids stop there: use StreamingDecoder to emit only complete
//   characters.
// - Special tokens: control tokens (and the unknown token) become their id in encode() only when
//   parse_special is set; otherwise their text is tokenized like any other. User-defined tokens (GGUF token
//   type 4, HF added tokens with special=false) are always matched whole. Among overlapping candidates the
//   leftmost, then longest, wins (as Hugging Face tokenizers matches added tokens).
// - A Tokenizer is immutable after construction and safe to use from several threads.
// - Errors (malformed metadata, a tokenizer type tessera does not implement) are tessera::Error naming the
// key.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera::model {

// Token types, numbered as GGUF numbers them (tokenizer.ggml.token_type).
enum class TokenType : int32_t {
  Undefined = 0,
  Normal = 1,
  Unknown = 2,
  Control = 3,      // <|im_start|>, <bos>, <end_of_turn>: matched in text only with parse_special
  UserDefined = 4,  // always matched whole in text; never produced by merges
  Unused = 5,
  Byte = 6,  // <0x0A>: SentencePiece byte fallback
};

enum class TokenizerKind { ByteLevelBPE, SentencePieceBPE };

// One step of a pre-tokenizer: the pieces made so far are each split by `pattern` (PCRE2, UTF + UCP), matches
// and the text between them handled as `behavior` says (Hugging Face's Split semantics). `prefix_space` steps
// instead prepend a space to every piece that does not start with one (HF ByteLevel add_prefix_space).
struct PreTokenizerStep {
  enum class Behavior { Isolated, Removed, MergedWithPrevious, MergedWithNext };
  std::string pattern;
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool prefix_space = false;
};

// The regex pre-tokenizers tessera knows by name (GGUF tokenizer.ggml.pre): "gpt2" (also "default"), "llama3"
// (also "llama-bpe", "llama-v3"), "qwen2" (also "deepseek-r1-qwen"), "smollm" (digits one by one, then GPT-2;
// also "starcoder", "refact"). Throws Error for other names.
std::vector<PreTokenizerStep> named_pre_tokenizer(std::string_view name);

enum class Normalizer { None, NFC };

struct SpecialTokens {
  int32_t bos = -1;  // -1: none
  int32_t eos = -1;
  int32_t eot = -1;  // end of turn (<|im_end|>, <|eot_id|>, <end_of_turn>); -1 when the vocabulary has none
  int32_t pad = -1;
  int32_t unk = -1;
  bool add_bos = false;  // encode() with add_special prepends bos
  bool add_eos = false;  // ... and appends eos
  std::vector<int32_t>
      end_of_generation;  // ids that end a generated reply: eos, eot and their known siblings
};

// Everything a tokenizer is made of; the loaders produce it, tests may write one by hand.
struct TokenizerData {
  TokenizerKind kind = TokenizerKind::ByteLevelBPE;
  std::vector<std::string> tokens;  // spelled as the vocabulary spells them ("Ġworld", "▁world", "<0x0A>")
  std::vector<TokenType> types;     // empty: Normal everywhere
  std::vector<float> scores;        // SentencePiece: merge priority of each piece (higher merges first)
  std::vector<std::pair<std::string, std::string>> merges;  // byte-level BPE, best first
  std::vector<PreTokenizerStep> pre_tokenizer;              // byte-level BPE
  std::string pre_tokenizer_name;  // for messages and tools ("smollm", "tokenizer.json")
  Normalizer normalizer = Normalizer::None;
  bool ignore_merges = false;  // byte-level BPE: a pre-token that is itself in the vocabulary is kept whole
  bool add_space_prefix =
      false;                  // SentencePiece: prepend a space to text at the start and after special tokens
  bool byte_fallback = true;  // SentencePiece: unknown characters become <0xXX> tokens (else unk)
  // HF added tokens that absorb whitespace to their left/right when matched (by id).
  std::vector<int32_t> lstrip_tokens, rstrip_tokens;
  SpecialTokens special;
};

// Sets special.eot (when unset) and special.end_of_generation from the well-known end-of-turn tokens of the
// vocabulary (<|eot_id|>, <|im_end|>, <end_of_turn>, <|endoftext|>, ...) plus eos. The loaders call it.
void complete_special_tokens(TokenizerData& data);

struct EncodeOptions {
  bool add_special = true;     // add BOS/EOS as the model asks (SpecialTokens::add_bos / add_eos)
  bool parse_special = false;  // text of control tokens becomes their id; off for untrusted text
};

// A place where encode() can pick up again (encode_from): the ids of `text` begin with the first `ids` ids encode()
// gave for text[0, text_pos), whatever comes after, for every text that starts with the same first `needs` bytes
// (needs >= text_pos: what the cut depends on past it). Found at control tokens and, in plain text without a
// normalizer, at word starts the pre-tokenizer or SentencePiece's merges never join across (tokenizers.md).
struct EncodeCheckpoint {
  size_t text_pos = 0;
  size_t ids = 0;
  size_t needs = 0;
  bool prefix_pending = true;  // SentencePiece: the text after text_pos would get a prefix space
};

struct DecodeOptions {
  bool skip_special = false;  // drop control/unknown tokens instead of rendering their text
};

class Tokenizer {
 public:
  explicit Tokenizer(TokenizerData data);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // From GGUF key/values (ModelFile::metadata()): tokenizer.ggml.{model, tokens, token_type, scores, merges,
  // pre, bos/eos/eot/unknown/padding_token_id, add_bos_token, add_eos_token, add_space_prefix}.
  static std::unique_ptr<Tokenizer> from_gguf(const nlohmann::json& metadata);
  // From a Hugging Face tokenizer.json (byte-level BPE models) and, optionally, its tokenizer_config.json
  // (add_bos_token, add_eos_token, bos/eos/pad/unk token names).
  static std::unique_ptr<Tokenizer> from_hf_json(
      const nlohmann::json& tokenizer_json,
      const nlohmann::json& tokenizer_config = nlohmann::json::object());
  // Reads `path` (a tokenizer.json) and tokenizer_config.json beside it when present.
  static std::unique_ptr<Tokenizer> from_hf_file(const std::string& path);
  // The data a GGUF describes, for tools and tests that want to adjust it before building.
  static TokenizerData gguf_data(const nlohmann::json& metadata);
  static TokenizerData hf_json_data(const nlohmann::json& tokenizer_json,
                                    const nlohmann::json& tokenizer_config = nlohmann::json::object());

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options = {}) const;
  // The same ids, and in `checkpoints` places to resume from (ascending; control tokens always, other places at
  // least `spacing` bytes after the previous one kept, and all of those in the text's last `spacing` bytes).
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options,
                              std::vector<EncodeCheckpoint>* checkpoints, size_t spacing = 0) const;
  // encode(text, options), given `before`: the first `from.ids` ids of another text encoded with the same options
  // that shares at least the first `from.needs` bytes with `text` (`from` one of its checkpoints). Encodes only
  // text[from.text_pos, end). Checkpoints found past from.text_pos are appended to `checkpoints` when given.
  std::vector<int32_t> encode_from(std::string_view text, const EncodeOptions& options,
                                   std::span<const int32_t> before, const EncodeCheckpoint& from,
                                   std::vector<EncodeCheckpoint>* checkpoints = nullptr, size_t spacing = 0) const;
  std::string decode(std::span<const int32_t> ids, const DecodeOptions& options = {}) const;

  // The bytes token `id` decodes to on its own (" world" for "Ġworld"; "\n" for "<0x0A>"); control and
  // unknown tokens give their text, or "" when render_special is false. Throws Error for ids out of range.
  std::string token_to_piece(int32_t id, bool render_special = true) const;
  // The vocabulary's spelling of token `id`.
  const std::string& token_text(int32_t id) const;
  TokenType token_type(int32_t id) const;
  std::optional<int32_t> find_token(std::string_view text) const;  // by vocabulary spelling
  int32_t vocab_size() const;

  TokenizerKind kind() const;
  const std::string& pre_tokenizer_name() const;
  bool add_space_prefix() const;
  const SpecialTokens& special() const;
  bool is_end_of_generation(int32_t id) const;
  bool is_special(int32_t id) const;  // control or unknown: what skip_special drops

  // The pre-tokens a byte-level BPE tokenizer would merge for plain `text` (no special tokens, no
  // normalizer); for tests and tools. For SentencePiece, the whole text.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of ids into text that is always whole UTF-8 characters: bytes of a character split across
// tokens are held until the character is complete; a byte that can never become part of a valid character is
// emitted as U+FFFD. The SentencePiece leading-space rule of decode() applies to the first token.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, DecodeOptions options = {})
      : tokenizer_(tokenizer), options_(options) {}
  // The text that became complete with token `id` (possibly empty).
  std::string push(int32_t id);
  // Whatever is still held (an unfinished character becomes U+FFFD); the decoder then starts afresh.
  std::string flush();

 private:
  const Tokenizer& tokenizer_;
  DecodeOptions options_;
  std::string pending_;
  bool first_ = true;
};

}  // namespace tessera::model

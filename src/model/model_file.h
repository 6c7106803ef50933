// tessera/model/model_file.h — one interface over model weight files: GGUF, safetensors, Hugging Face
// folders.
//
//   auto file = tessera::model::ModelFile::open("gemma-3-270m-q4_k_m.gguf");   // or x.safetensors, or an HF
//   dir const auto& cfg = file->metadata();                 // GGUF key/values, or the HF config.json const
//   TensorInfo& emb = file->get("token_embd.weight"); std::vector<float> row(emb.row_length());
//   dequantize_rows(emb, token_id, 1, row.data());      // quant.h
//
// Contract
// - Shapes are outermost first, as in numpy/PyTorch. A GGUF tensor with ne = [4096, 32000] (ne[0] innermost)
// has
//   shape {32000, 4096}: 32000 rows of 4096 contiguous elements. Quantized blocks run along the innermost
//   dimension, so a row is always a whole number of blocks.
// - Ownership: TensorInfo::data points into a read-only memory mapping owned by the ModelFile; it stays valid
// for
//   as long as the ModelFile lives. GGUF tensor data is aligned to the file's alignment (32 bytes by
//   default); safetensors data may be unaligned (read it with memcpy, as the dequantizers do).
// - Errors: every problem with an input file — missing, truncated, malformed, inconsistent, an unsupported
// type —
//   is a tessera::Error whose message starts with the file's path and names the problem
//   ("model.gguf: tensor blk.3.attn_q.weight has type IQ2_XS (17), which tessera does not read yet"). Opening
//   never allocates more than the file's size justifies, whatever counts the header claims.
// - Metadata strings are kept byte for byte; they are not checked to be UTF-8, so dump() such a json with
//   nlohmann::json::error_handler_t::replace if it may hold foreign bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/mapped_file.h"

namespace tessera::model {

// Tensor element types, numbered as ggml numbers them (the numbers are stored in GGUF files). The enum names
// the types tessera reads; other ggml numbers may still appear in a TensorType value read from a file, and
// tensor_type_name() knows their names for error messages.
enum class TensorType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 =
      9,  // named for completeness; tessera does not read it (it only ever exists inside ggml's dot products)
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  BF16 = 30,
};

// "Q4_K"; ggml's name for other known numbers ("IQ2_XS"); "unknown" otherwise.
std::string_view tensor_type_name(TensorType t);
// True for the types tessera can dequantize: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K
// Q8_K.
bool tensor_type_supported(TensorType t);
// Elements per block (1 for F32/F16/BF16, 32 for Q4_0..Q8_0, 256 for the K-quants) and bytes per block.
// Both return 0 for unsupported types.
size_t tensor_type_block_size(TensorType t);
size_t tensor_type_block_bytes(TensorType t);
// Bytes of `n` consecutive elements; n must be a multiple of the block size (throws Error otherwise).
size_t tensor_type_bytes(TensorType t, int64_t n);

struct TensorInfo {
  std::string name;
  TensorType type = TensorType::F32;
  std::vector<int64_t> shape;     // outermost first; every extent >= 1; empty for a scalar
  const uint8_t* data = nullptr;  // view into the file's mapping
  size_t bytes = 0;               // exactly tensor_type_bytes(type, numel())

  int64_t numel() const;
  int64_t row_length() const { return shape.empty() ? 1 : shape.back(); }  // innermost extent
  int64_t rows() const { return numel() / row_length(); }                  // product of the outer extents
  size_t row_bytes() const { return tensor_type_bytes(type, row_length()); }
  const uint8_t* row(int64_t r) const { return data + static_cast<size_t>(r) * row_bytes(); }
  std::string shape_string() const;  // "[32000, 4096]"
};

enum class FileFormat { GGUF, Safetensors };

// GGUF metadata value types, numbered as in the GGUF specification.
enum class GGUFType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};
std::string_view gguf_type_name(GGUFType t);  // "UINT32", "ARRAY", ...; "unknown" for other numbers

// The declared type of one GGUF metadata value, outermost first: {UINT32}; {ARRAY, STRING} for an array of
// strings; {ARRAY, ARRAY, STRING} for an array of arrays of strings. An empty array of arrays records only
// {ARRAY, ARRAY}; inner arrays are described by their first element's type.
using GGUFTypePath = std::vector<GGUFType>;

class ModelFile {
 public:
  // Opens `path`: a .gguf file, a .safetensors file, or a Hugging Face model directory (config.json plus the
  // *.safetensors shards named by model.safetensors.index.json, or else every *.safetensors file in it).
  // A file is recognised by its contents (GGUF magic) or its extension.
  static std::unique_ptr<ModelFile> open(const std::string& path);

  // What a loader produces; ModelFile's constructor indexes it and rejects duplicate tensor names.
  struct Contents {
    FileFormat format = FileFormat::GGUF;
    std::string path;
    nlohmann::json metadata = nlohmann::json::object();
    std::map<std::string, GGUFTypePath, std::less<>> gguf_types;  // GGUF only
    uint32_t gguf_version = 0;                                    // GGUF only
    size_t alignment = 0;                                         // GGUF only
    std::vector<TensorInfo> tensors;
    std::vector<std::shared_ptr<const MappedFile>> mappings;  // keep the tensor data alive
    std::optional<std::string> tokenizer_json;
  };
  explicit ModelFile(Contents contents);

  FileFormat format() const { return c_.format; }
  const std::string& path() const { return c_.path; }
  // GGUF: one entry per key/value ("general.architecture": "llama", "tokenizer.ggml.tokens": [...]); integers
  // and bools as json numbers and bools, FLOAT32 as the double of the same value. Safetensors: the parsed
  // config.json of the model's directory, or an empty object when there is none beside a single file.
  const nlohmann::json& metadata() const { return c_.metadata; }
  // GGUF: the declared type of a metadata key (nullptr for unknown keys and for safetensors).
  const GGUFTypePath* metadata_type(std::string_view key) const;
  uint32_t gguf_version() const { return c_.gguf_version; }  // 2 or 3; 0 for safetensors
  size_t alignment() const { return c_.alignment; }          // GGUF data alignment; 0 for safetensors

  // In file order (GGUF) or in name order per shard (safetensors).
  const std::vector<TensorInfo>& tensors() const { return c_.tensors; }
  const TensorInfo* find(std::string_view name) const;  // nullptr when absent
  const TensorInfo& get(std::string_view name) const;   // throws Error("<path>: missing tensor <name>")

  // The tokenizer.json beside the weights (HF directory, or the directory of a .safetensors file), if
  // present.
  std::optional<std::string> tokenizer_json_path() const { return c_.tokenizer_json; }

 private:
  Contents c_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

}  // namespace tessera::model

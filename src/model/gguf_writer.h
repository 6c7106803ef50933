// tessera/model/gguf_writer.h — writes GGUF version 3 (or 2) files.
//
//   GGUFWriter w;
//   w.add_string("general.architecture", "llama");
//   w.add("tokenizer.ggml.tokens", {GGUFType::ARRAY, GGUFType::STRING}, tokens_json);
//   w.add_tensor("token_embd.weight", TensorType::Q8_0, {32000, 4096}, bytes.data(), bytes.size());
//   w.write("model.gguf");
//
// Values are given as ModelFile::metadata() holds them (json) with their GGUF type path (as
// ModelFile::metadata_type() returns it), so a file read by tessera can be written back unchanged. The data
// alignment is general.alignment when that key is added (UINT32, a power of two), else 32. Tensor data is
// copied when added. Mismatched values (a string for UINT32, 300 for UINT8, a ragged tensor) throw Error.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/model_file.h"

namespace tessera::model {

class GGUFWriter {
 public:
  explicit GGUFWriter(uint32_t version = 3);

  void add(std::string key, GGUFTypePath type, nlohmann::json value);
  void add_string(std::string key, std::string value);
  void add_uint32(std::string key, uint32_t value);
  void add_int32(std::string key, int32_t value);
  void add_float32(std::string key, float value);
  void add_bool(std::string key, bool value);
  void add_string_array(std::string key, const std::vector<std::string>& values);

  // `shape` outermost first; `bytes` must equal tensor_type_bytes(type, numel).
  void add_tensor(std::string name, TensorType type, std::vector<int64_t> shape, const void* data,
                  size_t bytes);

  std::vector<uint8_t> bytes() const;         // the whole file
  void write(const std::string& path) const;  // Error("<path>: cannot write: ...") on failure

 private:
  struct KeyValue {
    std::string key;
    GGUFTypePath type;
    nlohmann::json value;
  };
  struct Tensor {
    std::string name;
    TensorType type;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
  };
  uint32_t version_;
  uint32_t alignment_ = 32;
  std::vector<KeyValue> kvs_;
  std::vector<Tensor> tensors_;
};

}  // namespace tessera::model

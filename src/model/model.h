// tessera/model/model.h — a loaded model: its file, its configuration and its weights (kept as stored: weights.h).
//
//   auto model = tessera::runtime::Model::load("tests/data/hf_tiny/llama3");   // HF dir, .safetensors or
//   .gguf tessera::runtime::Engine engine(*model);
//
// A Model is immutable after loading and may be shared by several Engines (each has its own KV cache).
#pragma once

#include <memory>
#include <string>

#include "core/thread_pool.h"
#include "model/model_file.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tessera::runtime {

class Model {
 public:
  // Opens `path` (model::ModelFile::open), reads the config and loads the weights. pool = nullptr uses
  // ThreadPool::global(). TESSERA_WEIGHTS=f32 in the environment sets options.expand_f32 (every weight expanded to
  // f32: the reference for accuracy and speed comparisons). Throws tessera::Error naming the file for every problem.
  static std::unique_ptr<Model> load(const std::string& path, ThreadPool* pool = nullptr,
                                     const WeightOptions& options = {});
  explicit Model(std::unique_ptr<model::ModelFile> file, ThreadPool* pool = nullptr,
                 const WeightOptions& options = {});

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  // The file stays open (memory-mapped): its metadata, its tokenizer and the weights kept in the mapping.
  const model::ModelFile& file() const { return *file_; }
  double load_seconds() const { return load_seconds_; }

 private:
  std::unique_ptr<model::ModelFile> file_;
  ModelConfig config_;
  ModelWeights weights_;
  double load_seconds_ = 0;
};

}  // namespace tessera::runtime

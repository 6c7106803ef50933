#include "model/model.h"

#include <chrono>

namespace tessera::runtime {

std::unique_ptr<Model> Model::load(const std::string& path, ThreadPool* pool, const WeightOptions& options) {
  return std::make_unique<Model>(model::ModelFile::open(path), pool, options);
}

Model::Model(std::unique_ptr<model::ModelFile> file, ThreadPool* pool, const WeightOptions& options)
    : file_(std::move(file)) {
  const auto t0 = std::chrono::steady_clock::now();
  config_ = load_model_config(*file_);
  weights_ = load_weights(*file_, config_, pool ? *pool : ThreadPool::global(), options);
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace tessera::runtime

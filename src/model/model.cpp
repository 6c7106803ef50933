#include "model/model.h"

#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"

namespace tessera::runtime {

std::unique_ptr<Model> Model::load(const std::string& path, ThreadPool* pool, const WeightOptions& options) {
  return std::make_unique<Model>(model::ModelFile::open(path), pool, options);
}

Model::Model(std::unique_ptr<model::ModelFile> file, ThreadPool* pool, const WeightOptions& options)
    : file_(std::move(file)) {
  const auto t0 = std::chrono::steady_clock::now();
  config_ = load_model_config(*file_);
  WeightOptions o = options;
  if (const char* env = std::getenv("TESSERA_WEIGHTS"); env != nullptr) {
    const std::string_view v(env);
    if (v == "f32") {
      o.expand_f32 = true;  // the f32 reference (comparisons of accuracy, memory and speed)
    } else if (v.substr(0, 4) == "f32:") {
      o.expand_f32_tensors = std::string(v.substr(4));  // those tensors alone (per-class accuracy experiments)
    } else if (!v.empty() && v != "stored") {
      throw Error("TESSERA_WEIGHTS=" + std::string(v) + ": expected f32, f32:NAME[,NAME...] or stored");
    }
  }
  if (const char* env = std::getenv("TESSERA_QACT_X2"); env != nullptr)
    o.int8x2_tensors = std::string_view(env) == "none" ? std::string() : std::string(env);
  if (const char* env = std::getenv("TESSERA_QACT_OUTLIERS"); env != nullptr)
    o.int8_outlier_tensors = std::string_view(env) == "none" ? std::string() : std::string(env);
  weights_ = load_weights(*file_, config_, pool ? *pool : ThreadPool::global(), o);
  load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace tessera::runtime

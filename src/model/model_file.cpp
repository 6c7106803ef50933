#include "model/model_file.h"

#include <filesystem>

#include "core/error.h"
#include "model/gguf.h"
#include "model/safetensors.h"

namespace tessera::model {

namespace fs = std::filesystem;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

ModelFile::ModelFile(Contents contents) : c_(std::move(contents)) {
  for (size_t i = 0; i < c_.tensors.size(); ++i) {
    if (!by_name_.emplace(c_.tensors[i].name, i).second) {
      throw Error(c_.path + ": duplicate tensor name " + c_.tensors[i].name);
    }
  }
}

std::unique_ptr<ModelFile> ModelFile::open(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return std::make_unique<ModelFile>(read_hf_directory(path));
  auto file = MappedFile::open(path);
  const std::string ext = fs::path(path).extension().string();
  if (looks_like_gguf(*file) || ext == ".gguf")
    return std::make_unique<ModelFile>(read_gguf(std::move(file)));
  // safetensors: by extension, or by its shape (a header length, then a JSON object).
  if (ext == ".safetensors" || (file->size() > 8 && file->data()[8] == '{')) {
    return std::make_unique<ModelFile>(read_safetensors_file(std::move(file)));
  }
  throw Error(path +
              ": not a model file tessera recognises (expected a .gguf file, a .safetensors file or a "
              "Hugging Face model directory)");
}

const GGUFTypePath* ModelFile::metadata_type(std::string_view key) const {
  auto it = c_.gguf_types.find(key);
  return it == c_.gguf_types.end() ? nullptr : &it->second;
}

const TensorInfo* ModelFile::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &c_.tensors[it->second];
}

const TensorInfo& ModelFile::get(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) throw Error(c_.path + ": missing tensor " + std::string(name));
  return *t;
}

}  // namespace tessera::model

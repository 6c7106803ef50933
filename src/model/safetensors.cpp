#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string>

#include "core/error.h"

namespace tessera::model {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the limit the safetensors format itself sets

std::string str(uint64_t v) {
  return std::to_string(v);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Parses JSON text; errors are "<path>: <what> is not valid JSON (parse error at byte N)".
json parse_json(const char* begin, const char* end, const std::string& path, const std::string& what) {
  try {
    return json::parse(begin, end);
  } catch (const json::parse_error& e) {
    throw Error(path + ": " + what + " is not valid JSON (parse error at byte " + str(e.byte) + ")");
  } catch (const json::exception& e) {  // e.g. out_of_range for a number too large for a double
    std::string detail = e.what();      // "[json.exception.out_of_range.406] number overflow parsing '1e999'"
    if (const size_t at = detail.find("] "); at != std::string::npos) detail.erase(0, at + 2);
    throw Error(path + ": " + what + " is not valid JSON (" + detail + ")");
  }
}

json read_json_file(const std::string& path) {
  auto file = MappedFile::open(path);
  const auto* p = reinterpret_cast<const char*>(file->data());
  json j = parse_json(p, p + file->size(), path, "the file");
  if (!j.is_object()) throw Error(path + ": is not a JSON object");
  return j;
}

bool dtype_of(const std::string& name, TensorType* type) {
  if (name == "F32")
    *type = TensorType::F32;
  else if (name == "F16")
    *type = TensorType::F16;
  else if (name == "BF16")
    *type = TensorType::BF16;
  else
    return false;
  return true;
}

// config.json and tokenizer.json beside the weights.
void read_sidecars(const fs::path& dir, bool config_required, const std::string& dir_text,
                   ModelFile::Contents* out) {
  const fs::path config = dir / "config.json";
  std::error_code ec;
  if (fs::is_regular_file(config, ec)) {
    out->metadata = read_json_file(config.string());
  } else if (config_required) {
    throw Error(dir_text + ": no config.json (a Hugging Face model directory needs one)");
  }
  const fs::path tokenizer = dir / "tokenizer.json";
  if (fs::is_regular_file(tokenizer, ec)) out->tokenizer_json = tokenizer.string();
}

}  // namespace

std::vector<TensorInfo> parse_safetensors(const MappedFile& file) {
  const std::string& path = file.path();
  const uint64_t size = file.size();
  if (size < 8) {
    throw Error(path + ": file is truncated: it has " + str(size) +
                " bytes, too few for the 8-byte safetensors header length");
  }
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len > size - 8) {
    throw Error(path + ": header length " + str(header_len) + " runs past the end of the file (size " +
                str(size) + ")");
  }
  if (header_len > kMaxHeaderBytes) {
    throw Error(path + ": header length " + str(header_len) + " exceeds the safetensors limit of " +
                str(kMaxHeaderBytes) + " bytes");
  }
  const auto* h = reinterpret_cast<const char*>(file.data() + 8);
  const json header = parse_json(h, h + header_len, path, "the header");
  if (!header.is_object()) throw Error(path + ": the header is not a JSON object");
  const uint8_t* buffer = file.data() + 8 + header_len;
  const uint64_t buffer_size = size - 8 - header_len;

  std::vector<TensorInfo> tensors;
  std::vector<uint64_t> begins;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    // Every later message names the tensor: an empty name would leave a gap in it ("tensor  has ...").
    if (name.empty()) throw Error(path + ": the header has a tensor with an empty name");
    const std::string where = path + ": tensor " + name;
    if (!entry.is_object()) throw Error(where + ": header entry is not a JSON object");
    const auto dtype = entry.find("dtype");
    const auto shape = entry.find("shape");
    const auto offsets = entry.find("data_offsets");
    if (dtype == entry.end() || !dtype->is_string())
      throw Error(where + ": header entry has no string \"dtype\"");
    if (shape == entry.end() || !shape->is_array() ||
        !std::all_of(shape->begin(), shape->end(), [](const json& d) { return d.is_number_integer(); })) {
      throw Error(where + ": header entry has no \"shape\" array of integers");
    }
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      throw Error(where + ": header entry has no \"data_offsets\" pair of non-negative integers");
    }
    TensorInfo t;
    t.name = name;
    const auto& dtype_name = dtype->get_ref<const std::string&>();
    if (!dtype_of(dtype_name, &t.type)) {
      throw Error(path + ": tensor " + name + " has dtype " + dtype_name +
                  ", which tessera does not read (it reads F32, F16 and BF16)");
    }
    for (size_t i = 0; i < shape->size(); ++i) {
      const json& d = (*shape)[i];
      if (d.is_number_unsigned() &&
          d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw Error(path + ": tensor " + name + " has dimension " + str(i) + " of size " +
                    str(d.get<uint64_t>()) + ", which does not fit in 64 bits");
      }
      const auto v = d.get<int64_t>();
      if (v <= 0) {
        throw Error(path + ": tensor " + name + " has dimension " + str(i) + " of size " + std::to_string(v) +
                    " (dimensions must be at least 1)");
      }
      t.shape.push_back(v);
    }
    int64_t numel = 1;
    uint64_t bytes = 0;
    for (int64_t d : t.shape) {
      if (__builtin_mul_overflow(numel, d, &numel)) {
        throw Error(path + ": tensor " + name + " has shape " + shape_text(t.shape) +
                    ", whose element count overflows 64 bits");
      }
    }
    if (__builtin_mul_overflow(static_cast<uint64_t>(numel), tensor_type_block_bytes(t.type), &bytes)) {
      throw Error(path + ": tensor " + name + " has shape " + shape_text(t.shape) +
                  ", whose size overflows 64 bits");
    }
    const auto begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
    if (end < begin || end - begin != bytes) {
      throw Error(path + ": tensor " + name + " has data_offsets [" + str(begin) + ", " + str(end) +
                  "], but " + dtype_name + " with shape " + shape_text(t.shape) + " needs " + str(bytes) +
                  " bytes");
    }
    if (end > buffer_size) {
      throw Error(path + ": tensor " + name + " has data_offsets [" + str(begin) + ", " + str(end) +
                  "], past the end of the data buffer (" + str(buffer_size) + " bytes)");
    }
    t.data = buffer + begin;
    t.bytes = static_cast<size_t>(bytes);
    tensors.push_back(std::move(t));
    begins.push_back(begin);
  }

  // File order, then reject overlaps.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return begins[a] < begins[b]; });
  for (size_t k = 1; k < order.size(); ++k) {
    if (begins[order[k]] < begins[order[k - 1]] + tensors[order[k - 1]].bytes) {
      throw Error(path + ": tensors " + tensors[order[k - 1]].name + " and " + tensors[order[k]].name +
                  " overlap in the data buffer");
    }
  }
  std::vector<TensorInfo> sorted;
  sorted.reserve(tensors.size());
  for (size_t k : order) sorted.push_back(std::move(tensors[k]));
  return sorted;
}

ModelFile::Contents read_safetensors_file(std::shared_ptr<const MappedFile> file) {
  ModelFile::Contents out;
  out.format = FileFormat::Safetensors;
  out.path = file->path();
  out.tensors = parse_safetensors(*file);
  fs::path dir = fs::path(file->path()).parent_path();
  if (dir.empty()) dir = ".";
  read_sidecars(dir, /*config_required=*/false, out.path, &out);
  out.mappings.push_back(std::move(file));
  return out;
}

ModelFile::Contents read_hf_directory(const std::string& dir_text) {
  const fs::path dir(dir_text);
  ModelFile::Contents out;
  out.format = FileFormat::Safetensors;
  out.path = dir_text;
  read_sidecars(dir, /*config_required=*/true, dir_text, &out);

  std::error_code ec;
  std::vector<std::string> shards;
  json weight_map;
  const fs::path index = dir / "model.safetensors.index.json";
  const std::string index_text = index.string();
  if (fs::is_regular_file(index, ec)) {
    const json j = read_json_file(index_text);
    const auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object() ||
        !std::all_of(wm->begin(), wm->end(), [](const json& v) { return v.is_string(); })) {
      throw Error(index_text + ": has no \"weight_map\" object of tensor name -> shard file");
    }
    weight_map = *wm;
    std::set<std::string> unique;
    for (const auto& [tensor, shard] : weight_map.items()) {
      if (tensor.empty()) throw Error(index_text + ": \"weight_map\" has a tensor with an empty name");
      const auto& name = shard.get_ref<const std::string&>();
      if (name.empty() || fs::path(name).filename() != fs::path(name)) {  // no "../x", "/abs", "sub/x"
        throw Error(index_text + ": shard name \"" + name + "\" (of tensor " + tensor +
                    ") is not a file name in the model directory");
      }
      if (unique.insert(name).second && !fs::is_regular_file(dir / name, ec)) {
        throw Error(index_text + ": shard " + name + " (of tensor " + tensor + ") does not exist");
      }
    }
    shards.assign(unique.begin(), unique.end());
  } else {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".safetensors" && entry.is_regular_file(ec)) {
        shards.push_back(entry.path().filename().string());
      }
    }
    if (ec) throw Error(dir_text + ": cannot list the directory: " + ec.message());
    std::sort(shards.begin(), shards.end());
    if (shards.empty())
      throw Error(dir_text + ": no *.safetensors files (and no model.safetensors.index.json)");
  }

  for (const std::string& shard : shards) {
    auto file = MappedFile::open((dir / shard).string());
    std::vector<TensorInfo> tensors = parse_safetensors(*file);
    if (!weight_map.is_null()) {
      std::set<std::string_view> held;
      for (const auto& t : tensors) held.insert(t.name);
      for (const auto& [tensor, name] : weight_map.items()) {
        if (name.get_ref<const std::string&>() == shard && held.count(tensor) == 0) {
          throw Error(index_text + ": names tensor " + tensor + " in shard " + shard +
                      ", which does not hold it");
        }
      }
    }
    for (auto& t : tensors) out.tensors.push_back(std::move(t));
    out.mappings.push_back(std::move(file));
  }
  return out;
}

}  // namespace tessera::model

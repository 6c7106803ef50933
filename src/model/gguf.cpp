#include "model/gguf.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <numeric>
#include <string>
#include <string_view>

#include "core/error.h"

namespace tessera::model {

namespace {

using json = nlohmann::json;

constexpr int kMaxArrayDepth =
    8;  // GGUF files nest at most 2 deep; the limit keeps hostile files off the stack
constexpr uint32_t kMaxDims = 4;                         // GGML_MAX_DIMS
constexpr uint64_t kMinKeyValueBytes = 8 + 4 + 1;        // empty key, type, one-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // empty name, n_dims = 0, type, offset

std::string str(uint64_t v) {
  return std::to_string(v);
}

// Each GGUF value type, indexed by its number: its name and the bytes of one value (for STRING and ARRAY the
// smallest possible encoding).
struct ValueType {
  std::string_view name;
  uint64_t min_bytes;
};

constexpr ValueType kValueTypes[] = {
    {"UINT8", 1}, {"INT8", 1},   {"UINT16", 2}, {"INT16", 2},  {"UINT32", 4}, {"INT32", 4},   {"FLOAT32", 4},
    {"BOOL", 1},  {"STRING", 8}, {"ARRAY", 12}, {"UINT64", 8}, {"INT64", 8},  {"FLOAT64", 8},
};
static_assert(std::size(kValueTypes) == static_cast<size_t>(GGUFType::FLOAT64) + 1);

bool known_value_type(uint32_t t) {
  return t < std::size(kValueTypes);
}

uint64_t min_value_bytes(GGUFType t) {
  return kValueTypes[static_cast<size_t>(t)].min_bytes;
}

// Reads little-endian values from the mapping, checking every read against the end of the file.
class Cursor {
 public:
  explicit Cursor(const MappedFile& file) : path_(file.path()), data_(file.data()), size_(file.size()) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  const std::string& path() const { return path_; }

  // `what` is a callable returning a description, evaluated only on failure (reads of 262k tokens stay
  // cheap).
  template <class What>
  void need(uint64_t n, const What& what) const {
    if (n > remaining()) {
      throw Error(path_ + ": file is truncated in " + what() + " (needs " + str(n) + " bytes at offset " +
                  str(pos_) + ", the file has " + str(size_) + ")");
    }
  }

  template <class T, class What>
  T get(const What& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  template <class What>
  std::string_view string(const What& what) {
    const auto n = get<uint64_t>(what);
    need(n, what);
    std::string_view s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }

 private:
  const std::string& path_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

class MetadataParser {
 public:
  explicit MetadataParser(Cursor& c) : c_(c) {}

  // Reads one value of type `type` for key `key`; appends its type path to `types` when non-null.
  json value(uint32_t type, const std::string& key, int depth, GGUFTypePath* types) {
    auto what = [&] { return "the value of metadata key " + key; };
    if (!known_value_type(type)) {
      throw Error(c_.path() + ": metadata key " + key + " has unknown value type " + str(type));
    }
    const auto t = static_cast<GGUFType>(type);
    if (types != nullptr) types->push_back(t);
    if (t == GGUFType::ARRAY) return array(key, depth, types);
    return scalar(t, what);
  }

 private:
  json array(const std::string& key, int depth, GGUFTypePath* types) {
    auto what = [&] { return "the array of metadata key " + key; };
    if (depth + 1 > kMaxArrayDepth) {
      throw Error(c_.path() + ": metadata key " + key + " nests arrays more than " + str(kMaxArrayDepth) +
                  " levels deep");
    }
    const auto elem_raw = c_.get<uint32_t>(what);
    const auto n = c_.get<uint64_t>(what);
    if (!known_value_type(elem_raw)) {
      throw Error(c_.path() + ": metadata key " + key + " is an array of unknown value type " +
                  str(elem_raw));
    }
    const auto elem = static_cast<GGUFType>(elem_raw);
    if (n > c_.remaining() / min_value_bytes(elem)) {
      throw Error(c_.path() + ": metadata key " + key + " claims an array of " + str(n) + " " +
                  std::string(gguf_type_name(elem)) + " values, more than the remaining " +
                  str(c_.remaining()) + " bytes of the file can hold");
    }
    json::array_t out;
    out.reserve(static_cast<size_t>(n));
    if (elem == GGUFType::ARRAY) {
      if (types != nullptr && n == 0) types->push_back(GGUFType::ARRAY);
      for (uint64_t i = 0; i < n; ++i) {
        out.push_back(value(elem_raw, key, depth + 1, i == 0 ? types : nullptr));
      }
      return out;
    }
    if (types != nullptr) types->push_back(elem);
    for (uint64_t i = 0; i < n; ++i) out.push_back(scalar(elem, what));
    return out;
  }

  // Reads one value of type `t`, which is not ARRAY.
  template <class What>
  json scalar(GGUFType t, const What& what) {
    switch (t) {
      case GGUFType::UINT8:
        return c_.get<uint8_t>(what);
      case GGUFType::INT8:
        return c_.get<int8_t>(what);
      case GGUFType::UINT16:
        return c_.get<uint16_t>(what);
      case GGUFType::INT16:
        return c_.get<int16_t>(what);
      case GGUFType::UINT32:
        return c_.get<uint32_t>(what);
      case GGUFType::INT32:
        return c_.get<int32_t>(what);
      case GGUFType::UINT64:
        return c_.get<uint64_t>(what);
      case GGUFType::INT64:
        return c_.get<int64_t>(what);
      case GGUFType::FLOAT32:
        return static_cast<double>(c_.get<float>(what));
      case GGUFType::FLOAT64:
        return c_.get<double>(what);
      case GGUFType::BOOL:
        return c_.get<uint8_t>(what) != 0;
      case GGUFType::STRING:
        return std::string(c_.string(what));
      case GGUFType::ARRAY:
        break;
    }
    return json();
  }

  Cursor& c_;
};

std::string hex_bytes(const uint8_t* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    if (i) s += ' ';
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string_view gguf_type_name(GGUFType t) {
  const auto i = static_cast<size_t>(t);
  return i < std::size(kValueTypes) ? kValueTypes[i].name : "unknown";
}

bool looks_like_gguf(const MappedFile& file) {
  return file.size() >= 4 && std::memcmp(file.data(), "GGUF", 4) == 0;
}

ModelFile::Contents read_gguf(std::shared_ptr<const MappedFile> file) {
  const std::string& path = file->path();
  Cursor c(*file);
  ModelFile::Contents out;
  out.format = FileFormat::GGUF;
  out.path = path;

  // ---- header
  if (file->size() < 4 || std::memcmp(file->data(), "GGUF", 4) != 0) {
    if (file->size() == 0) throw Error(path + ": not a GGUF file (it is empty)");
    throw Error(path + ": not a GGUF file (it starts with " +
                hex_bytes(file->data(), std::min<size_t>(4, file->size())) + ", not \"GGUF\")");
  }
  c.get<uint32_t>([] { return std::string("the magic"); });
  const auto version = c.get<uint32_t>([] { return std::string("the header"); });
  if (version != 2 && version != 3) {
    if (version != 0 && (version & 0xffffu) == 0) {
      throw Error(path + ": big-endian GGUF files are not supported (version field reads " + str(version) +
                  ")");
    }
    throw Error(path + ": unsupported GGUF version " + str(version) + " (tessera reads versions 2 and 3)");
  }
  out.gguf_version = version;
  const auto n_tensors = c.get<uint64_t>([] { return std::string("the header"); });
  const auto n_kv = c.get<uint64_t>([] { return std::string("the header"); });
  if (n_kv > c.remaining() / kMinKeyValueBytes) {
    throw Error(path + ": the header claims " + str(n_kv) + " metadata key/values, more than the " +
                str(c.remaining()) + " bytes after it can hold");
  }
  if (n_tensors > c.remaining() / kMinTensorInfoBytes) {
    throw Error(path + ": the header claims " + str(n_tensors) + " tensors, more than the " +
                str(c.remaining()) + " bytes after it can hold");
  }

  // ---- metadata
  MetadataParser parser(c);
  json::object_t meta;
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string index = str(i);
    std::string key(c.string([&] { return "the key of metadata entry " + index; }));
    const auto type = c.get<uint32_t>([&] { return "the type of metadata key " + key; });
    if (meta.count(key) != 0) throw Error(path + ": duplicate metadata key " + key);
    GGUFTypePath types;
    json v = parser.value(type, key, 0, &types);
    out.gguf_types.emplace(key, std::move(types));
    meta.emplace(std::move(key), std::move(v));
  }
  out.metadata = json(std::move(meta));

  uint64_t alignment = kGGUFDefaultAlignment;
  if (auto it = out.gguf_types.find("general.alignment"); it != out.gguf_types.end()) {
    if (it->second != GGUFTypePath{GGUFType::UINT32}) {
      throw Error(path + ": general.alignment has type " + std::string(gguf_type_name(it->second.front())) +
                  ", expected UINT32");
    }
    alignment = out.metadata["general.alignment"].get<uint64_t>();
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      throw Error(path + ": general.alignment is " + str(alignment) + ", which is not a power of two");
    }
  }
  out.alignment = static_cast<size_t>(alignment);
  if (auto it = out.metadata.find("split.count");
      it != out.metadata.end() && it->is_number_unsigned() && it->get<uint64_t>() > 1) {
    throw Error(path + ": is one part of a split GGUF model (split.count = " + str(it->get<uint64_t>()) +
                "); tessera does not read split GGUF files yet (merge them with llama-gguf-split --merge)");
  }

  // ---- tensor infos
  std::vector<uint64_t> offsets;
  out.tensors.reserve(static_cast<size_t>(n_tensors));
  offsets.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const std::string index = str(i);
    TensorInfo t;
    t.name = std::string(c.string([&] { return "the name of tensor info " + index; }));
    // Every later message names the tensor: an empty name would leave a gap in it ("tensor  has ...").
    if (t.name.empty()) throw Error(path + ": tensor info " + index + " has an empty name");
    auto what = [&] { return "tensor info " + index + " (" + t.name + ")"; };
    const auto n_dims = c.get<uint32_t>(what);
    if (n_dims > kMaxDims) {
      throw Error(path + ": tensor " + t.name + " has " + str(n_dims) + " dimensions (GGUF allows at most " +
                  str(kMaxDims) + ")");
    }
    t.shape.resize(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d)
      t.shape[n_dims - 1 - d] = c.get<int64_t>(what);  // ne[0] is innermost
    const auto type = c.get<uint32_t>(what);
    const auto offset = c.get<uint64_t>(what);
    t.type = static_cast<TensorType>(type);

    for (uint32_t d = 0; d < n_dims; ++d) {
      const int64_t ne = t.shape[n_dims - 1 - d];
      if (ne <= 0) {
        throw Error(path + ": tensor " + t.name + " has ne[" + str(d) + "] = " + std::to_string(ne) +
                    " (dimensions must be at least 1)");
      }
    }
    if (tensor_type_name(t.type) == "unknown") {
      throw Error(path + ": tensor " + t.name + " has unknown type " + str(type));
    }
    if (!tensor_type_supported(t.type)) {
      throw Error(path + ": tensor " + t.name + " has type " + std::string(tensor_type_name(t.type)) + " (" +
                  str(type) + "), which tessera does not read yet");
    }
    int64_t numel = 1;
    for (int64_t ne : t.shape) {
      if (__builtin_mul_overflow(numel, ne, &numel)) {
        throw Error(path + ": tensor " + t.name + " has shape " + shape_text(t.shape) +
                    ", whose element count overflows 64 bits");
      }
    }
    const auto block = static_cast<int64_t>(tensor_type_block_size(t.type));
    if (t.row_length() % block != 0) {
      throw Error(path + ": tensor " + t.name + " has rows of " + std::to_string(t.row_length()) +
                  " elements, not a multiple of the " + std::string(tensor_type_name(t.type)) +
                  " block size " + std::to_string(block));
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(numel / block), tensor_type_block_bytes(t.type),
                               &bytes) ||
        bytes > file->size()) {
      throw Error(path + ": tensor " + t.name + " (" + std::string(tensor_type_name(t.type)) + ", shape " +
                  shape_text(t.shape) + ") would need more bytes than the whole file holds (" +
                  str(file->size()) + ")");
    }
    if (offset % alignment != 0) {
      throw Error(path + ": tensor " + t.name + " has data offset " + str(offset) +
                  ", which is not a multiple of the alignment " + str(alignment));
    }
    t.bytes = static_cast<size_t>(bytes);
    out.tensors.push_back(std::move(t));
    offsets.push_back(offset);
  }

  // ---- data section
  const uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  const uint64_t size = file->size();
  for (size_t i = 0; i < out.tensors.size(); ++i) {
    TensorInfo& t = out.tensors[i];
    if (offsets[i] > size) {
      throw Error(path + ": tensor " + t.name + " has data offset " + str(offsets[i]) +
                  ", past the end of the file (size " + str(size) + ")");
    }
    const uint64_t begin = data_start + offsets[i], end = begin + t.bytes;  // no overflow: both terms <= size
    if (end > size) {
      throw Error(path + ": file is truncated: tensor " + t.name + " needs bytes [" + str(begin) + ", " +
                  str(end) + "), but the file has " + str(size));
    }
    t.data = file->data() + data_start + offsets[i];
  }
  std::vector<size_t> order(out.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  for (size_t k = 1; k < order.size(); ++k) {
    const size_t prev = order[k - 1], cur = order[k];
    if (offsets[cur] < offsets[prev] + out.tensors[prev].bytes) {
      throw Error(path + ": tensors " + out.tensors[prev].name + " and " + out.tensors[cur].name +
                  " overlap in the data section");
    }
  }
  out.mappings.push_back(std::move(file));
  return out;
}

}  // namespace tessera::model

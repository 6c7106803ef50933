#include "model/gguf_writer.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "core/error.h"

namespace tessera::model {

namespace {

using json = nlohmann::json;

class Bytes {
 public:
  explicit Bytes(std::vector<uint8_t>& out) : out_(out) {}
  template <class T>
  void put(T v) {
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  void put_string(const std::string& s) {
    put<uint64_t>(s.size());
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void pad_to(size_t alignment) { out_.resize((out_.size() + alignment - 1) / alignment * alignment, 0); }

 private:
  std::vector<uint8_t>& out_;
};

template <class T>
T integer(const std::string& key, const json& v, GGUFType t) {
  // json keeps non-negative integers as uint64 and negative ones as int64; check either against T's range.
  bool ok = false;
  if (v.is_number_unsigned()) {
    ok = v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  } else if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    if constexpr (std::numeric_limits<T>::is_signed) {
      ok = i >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
           i <= static_cast<int64_t>(std::numeric_limits<T>::max());
    } else {
      ok = i >= 0 && static_cast<uint64_t>(i) <= static_cast<uint64_t>(std::numeric_limits<T>::max());
    }
  }
  if (!ok)
    throw Error("GGUFWriter: key " + key + ": " + v.dump() + " is not a " + std::string(gguf_type_name(t)));
  return v.get<T>();
}

// Checks `v` against type[level..] and, when out != nullptr, encodes it (without the leading type tag).
void encode(const std::string& key, const GGUFTypePath& type, size_t level, const json& v, Bytes* out) {
  if (level >= type.size()) throw Error("GGUFWriter: key " + key + ": incomplete type path");
  const GGUFType t = type[level];
  auto mismatch = [&] {
    return Error("GGUFWriter: key " + key + ": " + v.dump() + " is not a " + std::string(gguf_type_name(t)));
  };
  switch (t) {
#define TESSERA_INT_CASE(TYPE, CT)       \
  case GGUFType::TYPE: {                 \
    const CT x = integer<CT>(key, v, t); \
    if (out) out->put<CT>(x);            \
    return;                              \
  }
    TESSERA_INT_CASE(UINT8, uint8_t)
    TESSERA_INT_CASE(INT8, int8_t)
    TESSERA_INT_CASE(UINT16, uint16_t)
    TESSERA_INT_CASE(INT16, int16_t)
    TESSERA_INT_CASE(UINT32, uint32_t)
    TESSERA_INT_CASE(INT32, int32_t)
    TESSERA_INT_CASE(UINT64, uint64_t)
    TESSERA_INT_CASE(INT64, int64_t)
#undef TESSERA_INT_CASE
    case GGUFType::FLOAT32:
      if (!v.is_number()) throw mismatch();
      if (out) out->put<float>(v.get<float>());
      return;
    case GGUFType::FLOAT64:
      if (!v.is_number()) throw mismatch();
      if (out) out->put<double>(v.get<double>());
      return;
    case GGUFType::BOOL:
      if (!v.is_boolean()) throw mismatch();
      if (out) out->put<uint8_t>(v.get<bool>() ? 1 : 0);
      return;
    case GGUFType::STRING:
      if (!v.is_string()) throw mismatch();
      if (out) out->put_string(v.get_ref<const std::string&>());
      return;
    case GGUFType::ARRAY: {
      if (!v.is_array()) throw mismatch();
      if (level + 1 >= type.size()) throw Error("GGUFWriter: key " + key + ": array without an element type");
      if (out) {
        out->put<uint32_t>(static_cast<uint32_t>(type[level + 1]));
        out->put<uint64_t>(v.size());
      }
      for (const json& e : v) encode(key, type, level + 1, e, out);
      return;
    }
  }
  throw Error("GGUFWriter: key " + key + ": unknown type " + std::to_string(static_cast<uint32_t>(t)));
}

}  // namespace

GGUFWriter::GGUFWriter(uint32_t version) : version_(version) {
  if (version != 2 && version != 3) throw Error("GGUFWriter: version must be 2 or 3");
}

void GGUFWriter::add(std::string key, GGUFTypePath type, json value) {
  encode(key, type, 0, value, nullptr);  // validate now, so errors point at the caller
  for (const auto& kv : kvs_) {
    if (kv.key == key) throw Error("GGUFWriter: duplicate key " + key);
  }
  if (key == "general.alignment") {
    const uint64_t a = value.is_number_integer() && value.get<int64_t>() > 0 ? value.get<uint64_t>() : 0;
    if (type != GGUFTypePath{GGUFType::UINT32} || a == 0 || (a & (a - 1)) != 0) {
      throw Error("GGUFWriter: general.alignment must be a UINT32 power of two");
    }
    alignment_ = static_cast<uint32_t>(a);
  }
  kvs_.push_back({std::move(key), std::move(type), std::move(value)});
}

void GGUFWriter::add_string(std::string key, std::string value) {
  add(std::move(key), {GGUFType::STRING}, json(std::move(value)));
}
void GGUFWriter::add_uint32(std::string key, uint32_t value) {
  add(std::move(key), {GGUFType::UINT32}, value);
}
void GGUFWriter::add_int32(std::string key, int32_t value) {
  add(std::move(key), {GGUFType::INT32}, value);
}
void GGUFWriter::add_float32(std::string key, float value) {
  add(std::move(key), {GGUFType::FLOAT32}, static_cast<double>(value));
}
void GGUFWriter::add_bool(std::string key, bool value) {
  add(std::move(key), {GGUFType::BOOL}, value);
}
void GGUFWriter::add_string_array(std::string key, const std::vector<std::string>& values) {
  add(std::move(key), {GGUFType::ARRAY, GGUFType::STRING}, json(values));
}

void GGUFWriter::add_tensor(std::string name, TensorType type, std::vector<int64_t> shape, const void* data,
                            size_t bytes) {
  if (shape.size() > 4) throw Error("GGUFWriter: tensor " + name + " has more than 4 dimensions");
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d <= 0) throw Error("GGUFWriter: tensor " + name + " has a dimension < 1");
    numel *= d;
  }
  const int64_t row = shape.empty() ? 1 : shape.back();
  if (!tensor_type_supported(type) || row % static_cast<int64_t>(tensor_type_block_size(type)) != 0) {
    throw Error("GGUFWriter: tensor " + name + ": rows of " + std::to_string(row) +
                " elements cannot be stored as " + std::string(tensor_type_name(type)));
  }
  if (bytes != tensor_type_bytes(type, numel)) {
    throw Error("GGUFWriter: tensor " + name + ": got " + std::to_string(bytes) + " bytes, " +
                std::string(tensor_type_name(type)) + " needs " +
                std::to_string(tensor_type_bytes(type, numel)));
  }
  for (const auto& t : tensors_) {
    if (t.name == name) throw Error("GGUFWriter: duplicate tensor " + name);
  }
  const auto* p = static_cast<const uint8_t*>(data);
  tensors_.push_back({std::move(name), type, std::move(shape), std::vector<uint8_t>(p, p + bytes)});
}

std::vector<uint8_t> GGUFWriter::bytes() const {
  std::vector<uint8_t> out;
  Bytes b(out);
  b.put<uint32_t>(0x46554747u);  // "GGUF" read as a little-endian uint32
  b.put<uint32_t>(version_);
  b.put<uint64_t>(tensors_.size());
  b.put<uint64_t>(kvs_.size());
  for (const auto& kv : kvs_) {
    b.put_string(kv.key);
    b.put<uint32_t>(static_cast<uint32_t>(kv.type.front()));
    encode(kv.key, kv.type, 0, kv.value, &b);
  }
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    b.put_string(t.name);
    b.put<uint32_t>(static_cast<uint32_t>(t.shape.size()));
    for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) b.put<int64_t>(*it);  // ne[0] innermost
    b.put<uint32_t>(static_cast<uint32_t>(t.type));
    b.put<uint64_t>(offset);
    offset = (offset + t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  b.pad_to(alignment_);
  for (const auto& t : tensors_) {
    out.insert(out.end(), t.data.begin(), t.data.end());
    b.pad_to(alignment_);
  }
  return out;
}

void GGUFWriter::write(const std::string& path) const {
  const std::vector<uint8_t> data = bytes();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (f) f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  if (f) f.close();
  if (!f) throw Error(path + ": cannot write: " + std::strerror(errno));
}

}  // namespace tessera::model

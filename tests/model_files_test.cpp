// Tests of src/model: memory-mapped files, the GGUF reader and writer, safetensors and Hugging Face
// directories, dequantisation of every supported ggml type, and one test per kind of bad input (exact error
// messages).
//
// Independence: malformed and hand-made GGUF files are built here byte by byte (RawFile below), not with
// tessera's GGUFWriter; quantized blocks are packed here from the documented layouts and checked against
// values computed here; tests/data/model_files/reference.gguf comes from gguf-py
// (scripts/make_model_fixtures.py).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/mapped_file.h"
#include "model/model_file.h"
#include "model/quant.h"
#include "model/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace tessera::model;

namespace {

const fs::path kData = fs::path(TESSERA_SOURCE_DIR) / "tests" / "data" / "model_files";

// ---- helpers
// -----------------------------------------------------------------------------------------------

// A fresh directory under the test temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string templ = (fs::path(testing::TempDir()) / "tessera_model_XXXXXX").string();
    if (mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void write_file(const std::string& path, const void* data, size_t size) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
}
void write_file(const std::string& path, const std::string& text) {
  write_file(path, text.data(), text.size());
}
void write_file(const std::string& path, const std::vector<uint8_t>& b) {
  write_file(path, b.data(), b.size());
}

// Little-endian byte builder for hand-made files.
struct RawFile {
  std::vector<uint8_t> b;
  template <class T>
  RawFile& put(T v) {
    const size_t at = b.size();
    b.resize(at + sizeof(T));
    std::memcpy(b.data() + at, &v, sizeof(T));
    return *this;
  }
  RawFile& u8(uint8_t v) { return put(v); }
  RawFile& u32(uint32_t v) { return put(v); }
  RawFile& u64(uint64_t v) { return put(v); }
  RawFile& i64(int64_t v) { return put(v); }
  RawFile& str(std::string_view s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  RawFile& bytes(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b.insert(b.end(), c, c + n);
    return *this;
  }
  RawFile& zeros(size_t n) {
    b.resize(b.size() + n, 0);
    return *this;
  }
  RawFile& pad(size_t alignment) {
    b.resize((b.size() + alignment - 1) / alignment * alignment, 0);
    return *this;
  }
  // GGUF header: magic, version, tensor count, key/value count.
  RawFile& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    b.insert(b.end(), {'G', 'G', 'U', 'F'});
    return u32(version).u64(n_tensors).u64(n_kv);
  }
  // Metadata key with a scalar type tag (the value follows).
  RawFile& key(std::string_view k, GGUFType t) { return str(k).u32(static_cast<uint32_t>(t)); }
  // Tensor info; ne innermost first, as stored.
  RawFile& tensor(std::string_view name, std::vector<int64_t> ne, uint32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(ne.size()));
    for (int64_t n : ne) i64(n);
    return u32(type).u64(offset);
  }
};

std::unique_ptr<ModelFile> load_gguf(const std::vector<uint8_t>& b, const std::string& name = "model.gguf") {
  return std::make_unique<ModelFile>(read_gguf(MappedFile::from_bytes(name, b.data(), b.size())));
}

std::string gguf_error(const std::vector<uint8_t>& b) {
  try {
    load_gguf(b);
  } catch (const tessera::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string safetensors_error(const std::vector<uint8_t>& b) {
  try {
    auto f = MappedFile::from_bytes("model.safetensors", b.data(), b.size());
    parse_safetensors(*f);
  } catch (const tessera::Error& e) {
    return e.what();
  }
  return "(no error)";
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const tessera::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A valid one-tensor GGUF: F32 tensor "w" with ne = {4, 2} (shape [2, 4]) holding 0..7.
RawFile one_f32_tensor() {
  RawFile f;
  f.header(1, 0).tensor("w", {4, 2}, 0, 0).pad(32);
  for (int i = 0; i < 8; ++i) f.put<float>(static_cast<float>(i));
  return f;
}

// A GGUF with no key/values and one tensor info; `data_bytes` zero bytes of data after the 32-byte padding.
std::vector<uint8_t> tensor_file(std::vector<int64_t> ne, uint32_t type, uint64_t offset, size_t data_bytes,
                                 std::string_view name = "blk.3.attn_q.weight") {
  RawFile f;
  f.header(1, 0).tensor(name, std::move(ne), type, offset).pad(32).zeros(data_bytes);
  return f.b;
}

uint16_t f16_bits(float x) {
  return tessera::f32_to_f16(x).bits;
}

std::vector<float> dequantized(const TensorInfo& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  dequantize(t, out.data());
  return out;
}

// Safetensors file from a header json and a data buffer.
std::vector<uint8_t> safetensors_bytes(const std::string& header, const std::vector<uint8_t>& data) {
  RawFile f;
  f.u64(header.size());
  f.bytes(header.data(), header.size());
  f.bytes(data.data(), data.size());
  return f.b;
}

// ---- memory-mapped files
// -----------------------------------------------------------------------------------

TEST(MappedFile, MapsAFileReadOnly) {
  TempDir dir;
  write_file(dir.file("a.bin"), std::string("hello"));
  auto f = MappedFile::open(dir.file("a.bin"));
  ASSERT_EQ(f->size(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f->data()), 5), "hello");
  EXPECT_EQ(f->path(), dir.file("a.bin"));
}

TEST(MappedFile, EmptyFileHasNoData) {
  TempDir dir;
  write_file(dir.file("empty"), std::string());
  auto f = MappedFile::open(dir.file("empty"));
  EXPECT_EQ(f->size(), 0u);
  EXPECT_EQ(f->data(), nullptr);
}

TEST(MappedFile, MissingFileNamesPathAndReason) {
  EXPECT_EQ(error_of([] { MappedFile::open("/nonexistent/model.gguf"); }),
            "/nonexistent/model.gguf: cannot open: No such file or directory");
}

TEST(MappedFile, DirectoryIsNotARegularFile) {
  TempDir dir;
  EXPECT_EQ(error_of([&] { MappedFile::open(dir.path().string()); }),
            dir.path().string() + ": not a regular file");
}

TEST(MappedFile, FifoIsRejectedWithoutBlocking) {
  TempDir dir;
  ASSERT_EQ(mkfifo(dir.file("pipe").c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { MappedFile::open(dir.file("pipe")); }), dir.file("pipe") + ": not a regular file");
}

TEST(MappedFile, FromBytesIsAlignedCopy) {
  const char text[] = "abc";
  auto f = MappedFile::from_bytes("mem", text, 3);
  EXPECT_EQ(f->size(), 3u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f->data()) % 64, 0u);
  EXPECT_EQ(std::memcmp(f->data(), "abc", 3), 0);
}

// ---- type traits
// ---------------------------------------------------------------------------------------------

TEST(TensorTypes, BlockSizesAndNames) {
  struct Row {
    TensorType t;
    const char* name;
    size_t block, bytes;
  };
  const Row rows[] = {{TensorType::F32, "F32", 1, 4},       {TensorType::F16, "F16", 1, 2},
                      {TensorType::BF16, "BF16", 1, 2},     {TensorType::Q4_0, "Q4_0", 32, 18},
                      {TensorType::Q4_1, "Q4_1", 32, 20},   {TensorType::Q5_0, "Q5_0", 32, 22},
                      {TensorType::Q5_1, "Q5_1", 32, 24},   {TensorType::Q8_0, "Q8_0", 32, 34},
                      {TensorType::Q2_K, "Q2_K", 256, 84},  {TensorType::Q3_K, "Q3_K", 256, 110},
                      {TensorType::Q4_K, "Q4_K", 256, 144}, {TensorType::Q5_K, "Q5_K", 256, 176},
                      {TensorType::Q6_K, "Q6_K", 256, 210}, {TensorType::Q8_K, "Q8_K", 256, 292}};
  for (const Row& r : rows) {
    EXPECT_EQ(tensor_type_name(r.t), r.name);
    EXPECT_TRUE(tensor_type_supported(r.t)) << r.name;
    EXPECT_EQ(tensor_type_block_size(r.t), r.block) << r.name;
    EXPECT_EQ(tensor_type_block_bytes(r.t), r.bytes) << r.name;
  }
  EXPECT_EQ(tensor_type_bytes(TensorType::Q4_K, 512), 288u);
  EXPECT_EQ(tensor_type_name(static_cast<TensorType>(17)), "IQ2_XS");
  EXPECT_FALSE(tensor_type_supported(static_cast<TensorType>(17)));
  EXPECT_FALSE(tensor_type_supported(TensorType::Q8_1));
  EXPECT_EQ(tensor_type_name(static_cast<TensorType>(1000)), "unknown");
  EXPECT_EQ(error_of([] { tensor_type_bytes(TensorType::Q4_0, 33); }),
            "tensor_type_bytes: 33 elements is not a whole number of Q4_0 blocks of 32");
}

// ---- GGUF: reading
// -------------------------------------------------------------------------------------------

TEST(GGUF, ReadsEveryMetadataTypeFromHandMadeFile) {
  RawFile f;
  f.header(0, 17);
  f.key("u8", GGUFType::UINT8).u8(250);
  f.key("i8", GGUFType::INT8).put<int8_t>(-7);
  f.key("u16", GGUFType::UINT16).put<uint16_t>(65000);
  f.key("i16", GGUFType::INT16).put<int16_t>(-32000);
  f.key("u32", GGUFType::UINT32).u32(4000000000u);
  f.key("i32", GGUFType::INT32).put<int32_t>(-2000000000);
  f.key("f32", GGUFType::FLOAT32).put<float>(0.1f);
  f.key("b", GGUFType::BOOL).u8(1);
  f.key("s", GGUFType::STRING).str("llama");
  f.key("u64", GGUFType::UINT64).u64(18446744073709551615ull);
  f.key("i64", GGUFType::INT64).i64(std::numeric_limits<int64_t>::min());
  f.key("f64", GGUFType::FLOAT64).put<double>(-2.5);
  f.key("strings", GGUFType::ARRAY).u32(8).u64(3).str("a").str("").str("\xff\xfe");
  f.key("ints", GGUFType::ARRAY).u32(5).u64(2).put<int32_t>(-1).put<int32_t>(7);
  f.key("floats", GGUFType::ARRAY).u32(6).u64(2).put<float>(1.5f).put<float>(-0.25f);
  f.key("nested", GGUFType::ARRAY).u32(9).u64(2);
  f.u32(8).u64(2).str("x").str("y");  // inner array 0: two strings
  f.u32(8).u64(1).str("z");           // inner array 1: one string
  f.key("empty", GGUFType::ARRAY).u32(4).u64(0);
  auto m = load_gguf(f.b);
  const json& md = m->metadata();
  EXPECT_EQ(m->format(), FileFormat::GGUF);
  EXPECT_EQ(m->gguf_version(), 3u);
  EXPECT_EQ(m->alignment(), 32u);
  EXPECT_EQ(md["u8"], 250);
  EXPECT_EQ(md["i8"], -7);
  EXPECT_EQ(md["u16"], 65000);
  EXPECT_EQ(md["i16"], -32000);
  EXPECT_EQ(md["u32"].get<uint64_t>(), 4000000000u);
  EXPECT_EQ(md["i32"], -2000000000);
  EXPECT_EQ(md["f32"].get<float>(), 0.1f);
  EXPECT_EQ(md["b"], true);
  EXPECT_EQ(md["s"], "llama");
  EXPECT_EQ(md["u64"].get<uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(md["i64"].get<int64_t>(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(md["f64"].get<double>(), -2.5);
  EXPECT_EQ(md["strings"], json({"a", "", "\xff\xfe"}));
  EXPECT_EQ(md["ints"], json({-1, 7}));
  EXPECT_EQ(md["floats"], json({1.5, -0.25}));
  EXPECT_EQ(md["nested"], json::parse(R"([["x", "y"], ["z"]])"));
  EXPECT_EQ(md["empty"], json::array());
  EXPECT_EQ(*m->metadata_type("u8"), GGUFTypePath{GGUFType::UINT8});
  EXPECT_EQ(*m->metadata_type("f64"), GGUFTypePath{GGUFType::FLOAT64});
  EXPECT_EQ(*m->metadata_type("strings"), (GGUFTypePath{GGUFType::ARRAY, GGUFType::STRING}));
  EXPECT_EQ(*m->metadata_type("nested"), (GGUFTypePath{GGUFType::ARRAY, GGUFType::ARRAY, GGUFType::STRING}));
  EXPECT_EQ(*m->metadata_type("empty"), (GGUFTypePath{GGUFType::ARRAY, GGUFType::UINT32}));
  EXPECT_EQ(m->metadata_type("absent"), nullptr);
  EXPECT_TRUE(m->tensors().empty());
}

TEST(GGUF, ReadsVersion2) {
  RawFile f;
  f.header(0, 1, 2).key("general.architecture", GGUFType::STRING).str("llama");
  auto m = load_gguf(f.b);
  EXPECT_EQ(m->gguf_version(), 2u);
  EXPECT_EQ(m->metadata()["general.architecture"], "llama");
}

TEST(GGUF, TensorShapeIsOutermostFirstAndDataIsAView) {
  RawFile f = one_f32_tensor();
  auto m = load_gguf(f.b);
  ASSERT_EQ(m->tensors().size(), 1u);
  const TensorInfo& t = m->get("w");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(t.shape_string(), "[2, 4]");
  EXPECT_EQ(t.type, TensorType::F32);
  EXPECT_EQ(t.numel(), 8);
  EXPECT_EQ(t.rows(), 2);
  EXPECT_EQ(t.row_length(), 4);
  EXPECT_EQ(t.bytes, 32u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 32, 0u);
  EXPECT_EQ(dequantized(t), (std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7}));
  std::vector<float> row(4);
  dequantize_rows(t, 1, 1, row.data());
  EXPECT_EQ(row, (std::vector<float>{4, 5, 6, 7}));
  EXPECT_EQ(m->find("missing"), nullptr);
  EXPECT_EQ(error_of([&] { m->get("missing"); }), "model.gguf: missing tensor missing");
}

TEST(GGUF, HonoursGeneralAlignment) {
  RawFile f;
  f.header(2, 1).key("general.alignment", GGUFType::UINT32).u32(64);
  f.tensor("a", {8}, 0, 0).tensor("b", {3}, 0, 64).pad(64);
  for (int i = 0; i < 16; ++i) f.put<float>(static_cast<float>(i));  // a: 0..7, padding 8..15
  for (int i = 0; i < 3; ++i) f.put<float>(100.0f + static_cast<float>(i));
  auto m = load_gguf(f.b);
  EXPECT_EQ(m->alignment(), 64u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->get("b").data) % 64, 0u);
  EXPECT_EQ(dequantized(m->get("b")), (std::vector<float>{100, 101, 102}));
}

TEST(GGUF, ScalarTensorHasEmptyShape) {
  RawFile f;
  f.header(1, 0).tensor("s", {}, 0, 0).pad(32).put<float>(3.5f);
  auto m = load_gguf(f.b);
  const TensorInfo& t = m->get("s");
  EXPECT_TRUE(t.shape.empty());
  EXPECT_EQ(t.numel(), 1);
  EXPECT_EQ(dequantized(t), std::vector<float>{3.5f});
}

TEST(GGUF, OpenDispatchesOnContentsAndExtension) {
  TempDir dir;
  write_file(dir.file("m.bin"), one_f32_tensor().b);  // recognised by its magic, not its name
  auto m = ModelFile::open(dir.file("m.bin"));
  EXPECT_EQ(m->format(), FileFormat::GGUF);
  EXPECT_EQ(m->path(), dir.file("m.bin"));
  EXPECT_EQ(m->tokenizer_json_path(), std::nullopt);
  write_file(dir.file("x.txt"), std::string("hello world"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.file("x.txt")); }),
            dir.file("x.txt") +
                ": not a model file tessera recognises (expected a .gguf file, a .safetensors file "
                "or a Hugging Face model directory)");
  write_file(dir.file("x.gguf"), std::string("hello world"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.file("x.gguf")); }),
            dir.file("x.gguf") + ": not a GGUF file (it starts with 68 65 6c 6c, not \"GGUF\")");
}

TEST(GGUF, LoadsATokenizerSizedStringArray) {
  // Gemma-3's vocabulary has 262144 tokens; make sure such an array parses into json without trouble.
  const int n = 262144;
  RawFile f;
  f.header(0, 1).key("tokenizer.ggml.tokens", GGUFType::ARRAY).u32(8).u64(n);
  for (int i = 0; i < n; ++i) f.str("tok" + std::to_string(i));
  auto m = load_gguf(f.b);
  const json& tokens = m->metadata()["tokenizer.ggml.tokens"];
  ASSERT_EQ(tokens.size(), static_cast<size_t>(n));
  EXPECT_EQ(tokens[0], "tok0");
  EXPECT_EQ(tokens[n - 1], "tok262143");
}

// ---- GGUF: the gguf-py fixture
// -------------------------------------------------------------------------------

class ReferenceGGUF : public testing::Test {
 protected:
  void SetUp() override { file_ = ModelFile::open((kData / "reference.gguf").string()); }
  std::unique_ptr<ModelFile> file_;
};

TEST_F(ReferenceGGUF, MetadataMatchesWhatGgufPyWrote) {
  const json& md = file_->metadata();
  EXPECT_EQ(md["general.architecture"], "fixture");
  EXPECT_EQ(md["test.uint8"], 200);
  EXPECT_EQ(md["test.int8"], -100);
  EXPECT_EQ(md["test.uint16"], 60000);
  EXPECT_EQ(md["test.int16"], -30000);
  EXPECT_EQ(md["test.uint32"].get<uint64_t>(), 4000000000u);
  EXPECT_EQ(md["test.int32"], -2000000000);
  EXPECT_EQ(md["test.float32"].get<float>(), 0.1f);
  EXPECT_EQ(md["test.uint64"].get<uint64_t>(), 18000000000000000000ull);
  EXPECT_EQ(md["test.int64"].get<int64_t>(), -9000000000000000000ll);
  EXPECT_EQ(md["test.float64"].get<double>(), 0.1);
  EXPECT_EQ(md["test.bool"], true);
  EXPECT_EQ(md["test.string"], "h\xc3\xa9llo w\xc3\xb6rld");
  EXPECT_EQ(md["test.array.uint8"], json({1, 2, 255}));
  EXPECT_EQ(md["test.array.int8"], json({-128, 0, 127}));
  EXPECT_EQ(md["test.array.uint16"], json({0, 65535}));
  EXPECT_EQ(md["test.array.int16"], json({-32768, 32767}));
  EXPECT_EQ(md["test.array.uint32"], json({0u, 4294967295u}));
  EXPECT_EQ(md["test.array.int32"], json({-2147483648ll, 2147483647}));
  EXPECT_EQ(md["test.array.uint64"], json({0ull, 18446744073709551615ull}));
  EXPECT_EQ(md["test.array.int64"],
            json({std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}));
  EXPECT_EQ(md["test.array.float32"], json({0.5, -1.25, static_cast<double>(0.1f)}));
  EXPECT_EQ(md["test.array.float64"], json({0.5, -1.25, 0.1}));
  EXPECT_EQ(md["test.array.bool"], json({true, false, true}));
  EXPECT_EQ(md["test.array.string"], json({"a", "", "<0x0A>", "\xc4\xa0\xc4\xa0"}));
  EXPECT_EQ(md["test.array.nested"], json::parse(R"([["x", "y"], ["z"]])"));
  const std::pair<const char*, GGUFType> scalars[] = {
      {"test.uint8", GGUFType::UINT8},     {"test.int8", GGUFType::INT8},
      {"test.uint16", GGUFType::UINT16},   {"test.int16", GGUFType::INT16},
      {"test.uint32", GGUFType::UINT32},   {"test.int32", GGUFType::INT32},
      {"test.float32", GGUFType::FLOAT32}, {"test.uint64", GGUFType::UINT64},
      {"test.int64", GGUFType::INT64},     {"test.float64", GGUFType::FLOAT64},
      {"test.bool", GGUFType::BOOL},       {"test.string", GGUFType::STRING}};
  for (const auto& [key, type] : scalars) {
    ASSERT_NE(file_->metadata_type(key), nullptr) << key;
    EXPECT_EQ(*file_->metadata_type(key), GGUFTypePath{type}) << key;
    const std::string array_key = "test.array." + std::string(key).substr(5);
    ASSERT_NE(file_->metadata_type(array_key), nullptr) << array_key;
    EXPECT_EQ(*file_->metadata_type(array_key), (GGUFTypePath{GGUFType::ARRAY, type})) << array_key;
  }
  EXPECT_EQ(*file_->metadata_type("test.array.nested"),
            (GGUFTypePath{GGUFType::ARRAY, GGUFType::ARRAY, GGUFType::STRING}));
}

TEST_F(ReferenceGGUF, DequantizationEqualsGgufPyExactly) {
  const char* types[] = {"F16",  "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                         "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
  for (const char* name : types) {
    const TensorInfo& q = file_->get(std::string("q.") + name);
    const TensorInfo& expected = file_->get(std::string("expected.") + name);
    EXPECT_EQ(tensor_type_name(q.type), name);
    ASSERT_EQ(q.shape, expected.shape) << name;
    const std::vector<float> got = dequantized(q), want = dequantized(expected);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << name << " element " << i;
    }
    // Row by row gives the same numbers.
    std::vector<float> row(static_cast<size_t>(q.row_length()));
    for (int64_t r = 0; r < q.rows(); ++r) {
      dequantize_rows(q, r, 1, row.data());
      ASSERT_EQ(0, std::memcmp(row.data(), got.data() + r * q.row_length(), row.size() * 4)) << name;
    }
  }
}

TEST_F(ReferenceGGUF, QuantizationEqualsGgufPyByteForByte) {
  const std::vector<float> source = dequantized(file_->get("source"));
  for (TensorType t : {TensorType::F16, TensorType::BF16, TensorType::Q4_0, TensorType::Q4_1,
                       TensorType::Q5_0, TensorType::Q5_1, TensorType::Q8_0}) {
    const TensorInfo& ref = file_->get("q." + std::string(tensor_type_name(t)));
    ASSERT_TRUE(quantize_supported(t));
    std::vector<uint8_t> mine(tensor_type_bytes(t, static_cast<int64_t>(source.size())));
    ASSERT_EQ(mine.size(), ref.bytes);
    quantize_row(t, source.data(), static_cast<int64_t>(source.size()), mine.data());
    EXPECT_EQ(0, std::memcmp(mine.data(), ref.data, ref.bytes)) << tensor_type_name(t);
  }
  EXPECT_EQ(error_of([] {
              float x[256] = {};
              uint8_t out[256];
              quantize_row(TensorType::Q4_K, x, 256, out);
            }),
            "quantize_row: tessera cannot quantize to Q4_K yet");
}

// ---- GGUF: writer
// -----------------------------------------------------------------------------------------------

TEST(GGUFWriter, RoundTripsMetadataAndTensors) {
  GGUFWriter w;
  w.add_string("general.architecture", "llama");
  w.add_uint32("llama.context_length", 8192);
  w.add_float32("llama.rope.freq_base", 10000.0f);
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  w.add_int32("i", -5);
  w.add_string_array("tokenizer.ggml.tokens", {"<s>", "</s>", "a"});
  w.add("nested", {GGUFType::ARRAY, GGUFType::ARRAY, GGUFType::INT16}, json::parse("[[1, -2], [], [3]]"));
  w.add("u64", {GGUFType::UINT64}, 18446744073709551615ull);
  w.add("general.alignment", {GGUFType::UINT32}, 64);
  const float values[3] = {1.0f, -2.0f, 0.5f};
  w.add_tensor("small", TensorType::F32, {3}, values, sizeof(values));
  std::vector<uint8_t> q8(tensor_type_bytes(TensorType::Q8_0, 64));
  std::vector<float> src(64);
  for (int i = 0; i < 64; ++i) src[static_cast<size_t>(i)] = static_cast<float>(i - 32) / 8.0f;
  quantize_row(TensorType::Q8_0, src.data(), 64, q8.data());
  w.add_tensor("q", TensorType::Q8_0, {2, 32}, q8.data(), q8.size());

  TempDir dir;
  w.write(dir.file("w.gguf"));
  auto m = ModelFile::open(dir.file("w.gguf"));
  EXPECT_EQ(m->alignment(), 64u);
  EXPECT_EQ(m->metadata()["general.architecture"], "llama");
  EXPECT_EQ(m->metadata()["llama.context_length"], 8192);
  EXPECT_EQ(m->metadata()["llama.rope.freq_base"], 10000.0);
  EXPECT_EQ(m->metadata()["tokenizer.ggml.add_bos_token"], true);
  EXPECT_EQ(m->metadata()["i"], -5);
  EXPECT_EQ(m->metadata()["tokenizer.ggml.tokens"], json({"<s>", "</s>", "a"}));
  EXPECT_EQ(m->metadata()["nested"], json::parse("[[1, -2], [], [3]]"));
  EXPECT_EQ(*m->metadata_type("nested"), (GGUFTypePath{GGUFType::ARRAY, GGUFType::ARRAY, GGUFType::INT16}));
  EXPECT_EQ(m->metadata()["u64"].get<uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(dequantized(m->get("small")), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  EXPECT_EQ(m->get("q").shape, (std::vector<int64_t>{2, 32}));
  EXPECT_EQ(0, std::memcmp(m->get("q").data, q8.data(), q8.size()));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->get("q").data) % 64, 0u);
}

TEST(GGUFWriter, RewritesTheReferenceFileFaithfully) {
  auto ref = ModelFile::open((kData / "reference.gguf").string());
  GGUFWriter w;
  for (const auto& [key, value] : ref->metadata().items()) w.add(key, *ref->metadata_type(key), value);
  for (const TensorInfo& t : ref->tensors()) w.add_tensor(t.name, t.type, t.shape, t.data, t.bytes);
  auto copy = load_gguf(w.bytes());
  EXPECT_EQ(copy->metadata(), ref->metadata());
  ASSERT_EQ(copy->tensors().size(), ref->tensors().size());
  for (size_t i = 0; i < ref->tensors().size(); ++i) {
    const TensorInfo &a = ref->tensors()[i], &b = copy->tensors()[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.type, b.type);
    EXPECT_EQ(a.shape, b.shape);
    ASSERT_EQ(a.bytes, b.bytes);
    EXPECT_EQ(0, std::memcmp(a.data, b.data, a.bytes)) << a.name;
    EXPECT_EQ(*copy->metadata_type("test.array.nested"), *ref->metadata_type("test.array.nested"));
  }
}

TEST(GGUFWriter, RejectsValuesThatDoNotFitTheirType) {
  GGUFWriter w;
  EXPECT_EQ(error_of([&] { w.add("k", {GGUFType::UINT8}, 300); }), "GGUFWriter: key k: 300 is not a UINT8");
  EXPECT_EQ(error_of([&] { w.add("k", {GGUFType::UINT32}, "x"); }),
            "GGUFWriter: key k: \"x\" is not a UINT32");
  EXPECT_EQ(error_of([&] { w.add("k", {GGUFType::ARRAY}, json::array()); }),
            "GGUFWriter: key k: array without an element type");
  w.add_uint32("k", 1);
  EXPECT_EQ(error_of([&] { w.add_uint32("k", 2); }), "GGUFWriter: duplicate key k");
  const uint8_t block[18] = {};
  EXPECT_EQ(error_of([&] { w.add_tensor("t", TensorType::Q4_0, {16}, block, 18); }),
            "GGUFWriter: tensor t: rows of 16 elements cannot be stored as Q4_0");
  EXPECT_EQ(error_of([&] { w.add_tensor("t", TensorType::Q4_0, {32}, block, 17); }),
            "GGUFWriter: tensor t: got 17 bytes, Q4_0 needs 18");
}

// ---- dequantization of hand-packed blocks
// ----------------------------------------------------------------------
//
// Each test packs random quants into a block following the layout in quant.h, then checks every element
// against the formula. Scales are small dyadic numbers, so every expected value is exact in f32.

class Blocks : public testing::Test {
 protected:
  std::mt19937 rng{12345};
  int rand_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
  static void put_f16(uint8_t* p, float x) {
    const uint16_t h = f16_bits(x);
    std::memcpy(p, &h, 2);
  }
  static std::vector<float> run(TensorType t, const std::vector<uint8_t>& b, int64_t n) {
    std::vector<float> y(static_cast<size_t>(n));
    dequantize_row(t, b.data(), n, y.data());
    return y;
  }
};

TEST_F(Blocks, F32F16BF16) {
  const std::vector<uint16_t> halves = {
      0x3C00, 0xC000, 0x0001, 0x7BFF, 0x7C00, 0xFC00,
      0x3555, 0x8000, 0x0400, 0x3800, 0xB400};  // 11: the SIMD path and a tail
  const std::vector<float> want = {1.0f,
                                   -2.0f,
                                   std::ldexp(1.0f, -24),
                                   65504.0f,
                                   std::numeric_limits<float>::infinity(),
                                   -std::numeric_limits<float>::infinity(),
                                   0.333251953125f,
                                   -0.0f,
                                   std::ldexp(1.0f, -14),
                                   0.5f,
                                   -0.25f};
  std::vector<uint8_t> b(halves.size() * 2);
  std::memcpy(b.data(), halves.data(), b.size());
  const auto got = run(TensorType::F16, b, static_cast<int64_t>(halves.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << i;
  EXPECT_TRUE(std::signbit(got[7]));

  const std::vector<uint16_t> brain = {0x3F80, 0xC040, 0x4049, 0x0000, 0x7F80};
  std::vector<uint8_t> bb(brain.size() * 2);
  std::memcpy(bb.data(), brain.data(), bb.size());
  EXPECT_EQ(run(TensorType::BF16, bb, 5),
            (std::vector<float>{1.0f, -3.0f, 3.140625f, 0.0f, std::numeric_limits<float>::infinity()}));

  const std::vector<float> f = {1.5f, -7.0f};
  std::vector<uint8_t> fb(8);
  std::memcpy(fb.data(), f.data(), 8);
  EXPECT_EQ(run(TensorType::F32, fb, 2), f);
}

TEST_F(Blocks, Q4_0) {
  std::vector<uint8_t> b(2 * 18);
  std::vector<float> want(64);
  for (int blk = 0; blk < 2; ++blk) {
    uint8_t* p = b.data() + blk * 18;
    const float d = blk == 0 ? 0.5f : -0.125f;
    put_f16(p, d);
    int q[32];
    for (int& v : q) v = rand_int(0, 15);
    for (int j = 0; j < 16; ++j) p[2 + j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
    for (int i = 0; i < 32; ++i) want[static_cast<size_t>(blk * 32 + i)] = d * static_cast<float>(q[i] - 8);
  }
  EXPECT_EQ(run(TensorType::Q4_0, b, 64), want);
}

TEST_F(Blocks, Q4_1) {
  std::vector<uint8_t> b(20);
  put_f16(b.data(), 0.25f);
  put_f16(b.data() + 2, -1.5f);
  int q[32];
  for (int& v : q) v = rand_int(0, 15);
  for (int j = 0; j < 16; ++j) b[static_cast<size_t>(4 + j)] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
  std::vector<float> want(32);
  for (int i = 0; i < 32; ++i) want[static_cast<size_t>(i)] = 0.25f * static_cast<float>(q[i]) - 1.5f;
  EXPECT_EQ(run(TensorType::Q4_1, b, 32), want);
}

// Q5_0/Q5_1: low nibbles as in Q4, the fifth bit of element i is bit i of the uint32 that follows the scales.
void pack_q5(const int* q, uint8_t* qh_at, uint8_t* qs_at) {
  uint32_t qh = 0;
  for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>((q[i] >> 4) & 1) << i;
  std::memcpy(qh_at, &qh, 4);
  for (int j = 0; j < 16; ++j) qs_at[j] = static_cast<uint8_t>((q[j] & 15) | ((q[j + 16] & 15) << 4));
}

TEST_F(Blocks, Q5_0) {
  std::vector<uint8_t> b(22);
  put_f16(b.data(), 0.125f);
  int q[32];
  for (int& v : q) v = rand_int(0, 31);
  pack_q5(q, b.data() + 2, b.data() + 6);
  std::vector<float> want(32);
  for (int i = 0; i < 32; ++i) want[static_cast<size_t>(i)] = 0.125f * static_cast<float>(q[i] - 16);
  EXPECT_EQ(run(TensorType::Q5_0, b, 32), want);
}

TEST_F(Blocks, Q5_1) {
  std::vector<uint8_t> b(24);
  put_f16(b.data(), 0.5f);
  put_f16(b.data() + 2, 2.0f);
  int q[32];
  for (int& v : q) v = rand_int(0, 31);
  pack_q5(q, b.data() + 4, b.data() + 8);
  std::vector<float> want(32);
  for (int i = 0; i < 32; ++i) want[static_cast<size_t>(i)] = 0.5f * static_cast<float>(q[i]) + 2.0f;
  EXPECT_EQ(run(TensorType::Q5_1, b, 32), want);
}

TEST_F(Blocks, Q8_0) {
  std::vector<uint8_t> b(34);
  put_f16(b.data(), 0.25f);
  std::vector<float> want(32);
  for (int i = 0; i < 32; ++i) {
    const auto q = static_cast<int8_t>(rand_int(-128, 127));
    std::memcpy(b.data() + 2 + i, &q, 1);
    want[static_cast<size_t>(i)] = 0.25f * static_cast<float>(q);
  }
  EXPECT_EQ(run(TensorType::Q8_0, b, 32), want);
}

TEST_F(Blocks, Q8_K) {
  std::vector<uint8_t> b(292);
  const float d = 0.0625f;
  std::memcpy(b.data(), &d, 4);
  std::vector<float> want(256);
  for (int i = 0; i < 256; ++i) {
    const auto q = static_cast<int8_t>(rand_int(-128, 127));
    std::memcpy(b.data() + 4 + i, &q, 1);
    want[static_cast<size_t>(i)] = d * static_cast<float>(q);
  }
  EXPECT_EQ(run(TensorType::Q8_K, b, 256), want);
}

// Element e of a K-quant super-block, split as e = 128 * half + 32 * s + l.
struct KPos {
  int half, s, l;
  explicit KPos(int e) : half(e / 128), s((e % 128) / 32), l(e % 32) {}
};

TEST_F(Blocks, Q2_K) {
  // {u8 scales[16]; u8 qs[64]; half d; half dmin}; 2-bit q at bits 2s of qs[32 half + l]; group e/16.
  std::vector<uint8_t> b(84, 0);
  put_f16(b.data() + 80, 0.5f);
  put_f16(b.data() + 82, 0.25f);
  int sc[16], mn[16], q[256];
  for (int g = 0; g < 16; ++g) {
    sc[g] = rand_int(0, 15);
    mn[g] = rand_int(0, 15);
    b[static_cast<size_t>(g)] = static_cast<uint8_t>(sc[g] | (mn[g] << 4));
  }
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    q[e] = rand_int(0, 3);
    const KPos p(e);
    b[static_cast<size_t>(16 + 32 * p.half + p.l)] |= static_cast<uint8_t>(q[e] << (2 * p.s));
    want[static_cast<size_t>(e)] = 0.5f * static_cast<float>(sc[e / 16]) * static_cast<float>(q[e]) -
                                   0.25f * static_cast<float>(mn[e / 16]);
  }
  EXPECT_EQ(run(TensorType::Q2_K, b, 256), want);
}

TEST_F(Blocks, Q3_K) {
  // {u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d}; value = low2 - (hmask bit ? 0 : 4), in [-4, 3].
  std::vector<uint8_t> b(110, 0);
  put_f16(b.data() + 108, 0.25f);
  int scale[16];
  for (int i = 0; i < 16; ++i) {
    scale[i] = rand_int(-32, 31);
    const int u = scale[i] + 32;  // 6 bits
    b[static_cast<size_t>(96 + i % 8)] |= static_cast<uint8_t>((u & 15) << (i < 8 ? 0 : 4));
    b[static_cast<size_t>(96 + 8 + i % 4)] |= static_cast<uint8_t>((u >> 4) << (2 * (i / 4)));
  }
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int v = rand_int(-4, 3);
    const int high = v >= 0 ? 1 : 0, low = v >= 0 ? v : v + 4;
    const KPos p(e);
    b[static_cast<size_t>(32 + 32 * p.half + p.l)] |= static_cast<uint8_t>(low << (2 * p.s));
    b[static_cast<size_t>(e % 32)] |= static_cast<uint8_t>(high << (e / 32));
    want[static_cast<size_t>(e)] = 0.25f * static_cast<float>(scale[e / 16]) * static_cast<float>(v);
  }
  EXPECT_EQ(run(TensorType::Q3_K, b, 256), want);
}

// The 12-byte Q4_K/Q5_K scale block: 8 groups of a 6-bit scale and a 6-bit min.
void pack_k_scales(const int* sc, const int* mn, uint8_t* s) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      s[j] |= static_cast<uint8_t>(sc[j]);
      s[j + 4] |= static_cast<uint8_t>(mn[j]);
    } else {
      s[j + 4] |= static_cast<uint8_t>((sc[j] & 15) | ((mn[j] & 15) << 4));
      s[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
      s[j] |= static_cast<uint8_t>((mn[j] >> 4) << 6);
    }
  }
}

TEST_F(Blocks, Q4_K) {
  // {half d; half dmin; u8 scales[12]; u8 qs[128]}; element e = 64 c + 32 half + l is nibble `half` of
  // qs[32 c + l]; group e / 32.
  std::vector<uint8_t> b(144, 0);
  put_f16(b.data(), 0.5f);
  put_f16(b.data() + 2, 0.125f);
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = rand_int(0, 63);
    mn[j] = rand_int(0, 63);
  }
  pack_k_scales(sc, mn, b.data() + 4);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rand_int(0, 15), c = e / 64, half = (e / 32) % 2, l = e % 32;
    b[static_cast<size_t>(16 + 32 * c + l)] |= static_cast<uint8_t>(q << (4 * half));
    want[static_cast<size_t>(e)] = 0.5f * static_cast<float>(sc[e / 32]) * static_cast<float>(q) -
                                   0.125f * static_cast<float>(mn[e / 32]);
  }
  EXPECT_EQ(run(TensorType::Q4_K, b, 256), want);
}

TEST_F(Blocks, Q5_K) {
  // {half d; half dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}; fifth bit of e is bit e/32 of qh[e % 32].
  std::vector<uint8_t> b(176, 0);
  put_f16(b.data(), 0.25f);
  put_f16(b.data() + 2, 0.5f);
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = rand_int(0, 63);
    mn[j] = rand_int(0, 63);
  }
  pack_k_scales(sc, mn, b.data() + 4);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rand_int(0, 31), c = e / 64, half = (e / 32) % 2, l = e % 32;
    b[static_cast<size_t>(48 + 32 * c + l)] |= static_cast<uint8_t>((q & 15) << (4 * half));
    b[static_cast<size_t>(16 + l)] |= static_cast<uint8_t>((q >> 4) << (e / 32));
    want[static_cast<size_t>(e)] = 0.25f * static_cast<float>(sc[e / 32]) * static_cast<float>(q) -
                                   0.5f * static_cast<float>(mn[e / 32]);
  }
  EXPECT_EQ(run(TensorType::Q5_K, b, 256), want);
}

TEST_F(Blocks, Q6_K) {
  // {u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}; low 4 bits of e in nibble (s >= 2) of
  // ql[64 half + 32 (s & 1) + l], top 2 bits at bits 2s of qh[32 half + l]; value q - 32; group e / 16.
  std::vector<uint8_t> b(210, 0);
  put_f16(b.data() + 208, 0.0625f);
  int scale[16];
  for (int g = 0; g < 16; ++g) {
    scale[g] = rand_int(-128, 127);
    const auto s8 = static_cast<int8_t>(scale[g]);
    std::memcpy(b.data() + 192 + g, &s8, 1);
  }
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rand_int(0, 63);
    const KPos p(e);
    b[static_cast<size_t>(64 * p.half + 32 * (p.s & 1) + p.l)] |=
        static_cast<uint8_t>((q & 15) << (4 * (p.s >> 1)));
    b[static_cast<size_t>(128 + 32 * p.half + p.l)] |= static_cast<uint8_t>((q >> 4) << (2 * p.s));
    want[static_cast<size_t>(e)] = 0.0625f * static_cast<float>(scale[e / 16]) * static_cast<float>(q - 32);
  }
  EXPECT_EQ(run(TensorType::Q6_K, b, 256), want);
}

TEST_F(Blocks, RowRangesAndErrors) {
  // A [3, 32] Q8_0 tensor: rows are single blocks with d = row + 1.
  std::vector<uint8_t> b(3 * 34, 0);
  for (int r = 0; r < 3; ++r) {
    put_f16(b.data() + r * 34, static_cast<float>(r + 1));
    for (int j = 0; j < 32; ++j) b[static_cast<size_t>(r * 34 + 2 + j)] = static_cast<uint8_t>(j);
  }
  TensorInfo t{"emb", TensorType::Q8_0, {3, 32}, b.data(), b.size()};
  std::vector<float> rows(64);
  dequantize_rows(t, 1, 2, rows.data());
  EXPECT_EQ(rows[0], 0.0f);
  EXPECT_EQ(rows[31], 2.0f * 31);
  EXPECT_EQ(rows[32 + 5], 3.0f * 5);
  EXPECT_EQ(error_of([&] { dequantize_rows(t, 2, 2, rows.data()); }),
            "tensor emb: rows [2, 4) are outside [0, 3)");
  EXPECT_EQ(error_of([&] { dequantize_rows(t, -1, 1, rows.data()); }),
            "tensor emb: rows [-1, 0) are outside [0, 3)");
  EXPECT_EQ(error_of([&] { dequantize_row(TensorType::Q8_0, b.data(), 31, rows.data()); }),
            "dequantize_row: 31 elements is not a whole number of Q8_0 blocks of 32");
  EXPECT_EQ(error_of([&] { dequantize_row(static_cast<TensorType>(20), b.data(), 32, rows.data()); }),
            "dequantize_row: tensor type IQ4_NL (20) is not supported");
}

// ---- GGUF: bad inputs, one test each
// -------------------------------------------------------------------------

TEST(GGUFErrors, EmptyFile) {
  EXPECT_EQ(gguf_error({}), "model.gguf: not a GGUF file (it is empty)");
}

TEST(GGUFErrors, WrongMagic) {
  EXPECT_EQ(gguf_error({'G', 'G', 'M', 'L', 3, 0, 0, 0}),
            "model.gguf: not a GGUF file (it starts with 47 47 4d 4c, not \"GGUF\")");
}

TEST(GGUFErrors, TruncatedHeader) {
  RawFile f;
  f.header(0, 0);
  f.b.resize(12);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: file is truncated in the header (needs 8 bytes at offset 8, the file has 12)");
}

TEST(GGUFErrors, Version1) {
  RawFile f;
  f.header(0, 0, 1);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: unsupported GGUF version 1 (tessera reads versions 2 and 3)");
}

TEST(GGUFErrors, FutureVersion) {
  RawFile f;
  f.header(0, 0, 4);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: unsupported GGUF version 4 (tessera reads versions 2 and 3)");
}

TEST(GGUFErrors, BigEndian) {
  RawFile f;
  f.header(0, 0, 0x03000000u);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: big-endian GGUF files are not supported (version field reads 50331648)");
}

TEST(GGUFErrors, AbsurdKeyValueCount) {
  RawFile f;
  f.header(0, 1ull << 60).zeros(100);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: the header claims 1152921504606846976 metadata key/values, more than "
            "the 100 bytes after it can hold");
}

TEST(GGUFErrors, AbsurdTensorCount) {
  RawFile f;
  f.header(1000, 0).zeros(100);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: the header claims 1000 tensors, more than the 100 bytes after it can hold");
}

TEST(GGUFErrors, TruncatedMetadataKey) {
  RawFile f;
  f.header(0, 1).u64(1000).zeros(20);  // key length 1000, 20 bytes left
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: file is truncated in the key of metadata entry 0 (needs 1000 bytes at "
            "offset 32, the file has 52)");
}

TEST(GGUFErrors, TruncatedMetadataValue) {
  RawFile f;
  f.header(0, 1).key("general.name", GGUFType::STRING).u64(50).bytes("abc", 3);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: file is truncated in the value of metadata key general.name (needs 50 "
            "bytes at offset 56, the file has 59)");
}

TEST(GGUFErrors, TruncatedScalarValue) {
  RawFile f;
  f.header(0, 1).key("llama.block_count", GGUFType::UINT32).u8(7);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: file is truncated in the value of metadata key llama.block_count (needs 4 "
            "bytes at offset 53, the file has 54)");
}

TEST(GGUFErrors, AbsurdArrayLength) {
  RawFile f;
  f.header(0, 1).key("tokenizer.ggml.tokens", GGUFType::ARRAY).u32(8).u64(1ull << 40).str("a").str("b");
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: metadata key tokenizer.ggml.tokens claims an array of 1099511627776 "
            "STRING values, more than the remaining 18 bytes of the file can hold");
}

TEST(GGUFErrors, TruncatedArrayElement) {
  RawFile f;
  f.header(0, 1).key("tokenizer.ggml.tokens", GGUFType::ARRAY).u32(8).u64(2).str("a").u64(5).bytes("ab", 2);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: file is truncated in the array of metadata key tokenizer.ggml.tokens "
            "(needs 5 bytes at offset 86, the file has 88)");
}

TEST(GGUFErrors, UnknownValueType) {
  RawFile f;
  f.header(0, 1).str("k").u32(13).u32(0);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: metadata key k has unknown value type 13");
}

TEST(GGUFErrors, UnknownArrayElementType) {
  RawFile f;
  f.header(0, 1).key("k", GGUFType::ARRAY).u32(77).u64(0);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: metadata key k is an array of unknown value type 77");
}

TEST(GGUFErrors, ArraysNestedTooDeep) {
  RawFile f;
  f.header(0, 1).key("k", GGUFType::ARRAY);
  for (int i = 0; i < 20; ++i) f.u32(9).u64(1);
  f.zeros(16);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: metadata key k nests arrays more than 8 levels deep");
}

TEST(GGUFErrors, DuplicateKey) {
  RawFile f;
  f.header(0, 2).key("a", GGUFType::UINT8).u8(1).key("a", GGUFType::UINT8).u8(2);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: duplicate metadata key a");
}

TEST(GGUFErrors, AlignmentOfWrongType) {
  RawFile f;
  f.header(0, 1).key("general.alignment", GGUFType::UINT64).u64(64);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: general.alignment has type UINT64, expected UINT32");
}

TEST(GGUFErrors, AlignmentNotPowerOfTwo) {
  RawFile f;
  f.header(0, 1).key("general.alignment", GGUFType::UINT32).u32(48);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: general.alignment is 48, which is not a power of two");
}

TEST(GGUFErrors, SplitFile) {
  RawFile f;
  f.header(0, 1).key("split.count", GGUFType::UINT16).put<uint16_t>(3);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: is one part of a split GGUF model (split.count = 3); tessera does not "
            "read split GGUF files yet (merge them with llama-gguf-split --merge)");
}

TEST(GGUFErrors, TruncatedTensorInfo) {
  RawFile f;
  f.header(1, 0).str("blk.0.attn_q.weight").u32(2).i64(64).zeros(4);
  EXPECT_EQ(gguf_error(f.b),
            "model.gguf: file is truncated in tensor info 0 (blk.0.attn_q.weight) (needs 8 bytes "
            "at offset 63, the file has 67)");
}

TEST(GGUFErrors, TooManyDimensions) {
  EXPECT_EQ(gguf_error(tensor_file({1, 1, 1, 1, 1}, 0, 0, 64)),
            "model.gguf: tensor blk.3.attn_q.weight has 5 dimensions (GGUF allows at most 4)");
}

TEST(GGUFErrors, ZeroDimension) {
  EXPECT_EQ(gguf_error(tensor_file({32, 0}, 0, 0, 64)),
            "model.gguf: tensor blk.3.attn_q.weight has ne[1] = 0 (dimensions must be at least 1)");
}

TEST(GGUFErrors, NegativeDimension) {
  EXPECT_EQ(gguf_error(tensor_file({-4}, 0, 0, 64)),
            "model.gguf: tensor blk.3.attn_q.weight has ne[0] = -4 (dimensions must be at least 1)");
}

TEST(GGUFErrors, ElementCountOverflow) {
  EXPECT_EQ(gguf_error(tensor_file({1ll << 32, 1ll << 32}, 0, 0, 64)),
            "model.gguf: tensor blk.3.attn_q.weight has shape [4294967296, 4294967296], whose element count "
            "overflows 64 bits");
}

TEST(GGUFErrors, TensorLargerThanFile) {
  EXPECT_EQ(gguf_error(tensor_file({4096, 32000}, 0, 0, 64)),
            "model.gguf: tensor blk.3.attn_q.weight (F32, shape [32000, 4096]) would need more bytes than "
            "the whole "
            "file holds (160)");
}

TEST(GGUFErrors, UnsupportedTensorType) {
  EXPECT_EQ(gguf_error(tensor_file({256}, 17, 0, 64)),
            "model.gguf: tensor blk.3.attn_q.weight has type IQ2_XS (17), which tessera does not read yet");
}

TEST(GGUFErrors, UnknownTensorType) {
  EXPECT_EQ(gguf_error(tensor_file({256}, 99, 0, 64)),
            "model.gguf: tensor blk.3.attn_q.weight has unknown type 99");
}

TEST(GGUFErrors, RowNotAWholeNumberOfBlocks) {
  EXPECT_EQ(gguf_error(tensor_file({100, 2}, 12, 0, 512)),
            "model.gguf: tensor blk.3.attn_q.weight has rows of 100 elements, not a multiple of the Q4_K "
            "block size "
            "256");
}

TEST(GGUFErrors, MisalignedOffset) {
  EXPECT_EQ(gguf_error(tensor_file({4}, 0, 4, 64)),
            "model.gguf: tensor blk.3.attn_q.weight has data offset 4, which is not a multiple of the "
            "alignment 32");
}

TEST(GGUFErrors, OffsetPastEnd) {
  EXPECT_EQ(
      gguf_error(tensor_file({4}, 0, 1ull << 40, 64)),
      "model.gguf: tensor blk.3.attn_q.weight has data offset 1099511627776, past the end of the file (size "
      "160)");
}

TEST(GGUFErrors, TruncatedData) {
  EXPECT_EQ(gguf_error(tensor_file({32}, 0, 0, 100)),
            "model.gguf: file is truncated: tensor blk.3.attn_q.weight needs bytes [96, 224), but the file "
            "has 196");
}

TEST(GGUFErrors, OverlappingTensors) {
  RawFile f;
  f.header(2, 0).tensor("a", {16}, 0, 0).tensor("b", {16}, 0, 32).pad(32).zeros(128);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: tensors a and b overlap in the data section");
}

TEST(GGUFErrors, EmptyTensorName) {
  // Accepted before: every later message about the tensor printed an empty name ("tensor  has ...").
  RawFile f;
  f.header(2, 0).tensor("a", {4}, 0, 0).tensor("", {4}, 0, 32).pad(32).zeros(64);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: tensor info 1 has an empty name");
}

TEST(GGUFErrors, DuplicateTensorName) {
  RawFile f;
  f.header(2, 0).tensor("a", {8}, 0, 0).tensor("a", {8}, 0, 32).pad(32).zeros(64);
  EXPECT_EQ(gguf_error(f.b), "model.gguf: duplicate tensor name a");
}

// ---- safetensors
// ------------------------------------------------------------------------------------------------

std::vector<uint8_t> floats_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(Safetensors, ReadsF32F16BF16InDataOrder) {
  std::vector<uint8_t> data = floats_bytes({1, 2, 3, 4, 5, 6});  // "a" [2, 3] F32
  for (uint16_t h : {uint16_t{0x3C00}, uint16_t{0xC000}})
    data.insert(data.end(), {uint8_t(h & 255), uint8_t(h >> 8)});
  for (uint16_t h : {uint16_t{0x3F80}, uint16_t{0x4049}})
    data.insert(data.end(), {uint8_t(h & 255), uint8_t(h >> 8)});
  const std::string header = R"({"__metadata__": {"format": "pt"},
    "z.bf16": {"dtype": "BF16", "shape": [2], "data_offsets": [28, 32]},
    "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "m.half": {"dtype": "F16", "shape": [1, 2], "data_offsets": [24, 28]}})";
  TempDir dir;
  write_file(dir.file("model.safetensors"), safetensors_bytes(header, data));
  auto m = ModelFile::open(dir.file("model.safetensors"));
  EXPECT_EQ(m->format(), FileFormat::Safetensors);
  EXPECT_EQ(m->metadata(), json::object());  // no config.json beside it
  ASSERT_EQ(m->tensors().size(), 3u);
  EXPECT_EQ(m->tensors()[0].name, "a");
  EXPECT_EQ(m->tensors()[1].name, "m.half");
  EXPECT_EQ(m->tensors()[2].name, "z.bf16");
  EXPECT_EQ(m->get("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(dequantized(m->get("a")), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(dequantized(m->get("m.half")), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(dequantized(m->get("z.bf16")), (std::vector<float>{1.0f, 3.140625f}));
  EXPECT_EQ(m->get("z.bf16").type, TensorType::BF16);
}

TEST(Safetensors, SingleFileSeesConfigAndTokenizerBesideIt) {
  TempDir dir;
  write_file(dir.file("weights.safetensors"),
             safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                               floats_bytes({7})));
  write_file(dir.file("config.json"), std::string(R"({"model_type": "llama"})"));
  write_file(dir.file("tokenizer.json"), std::string("{}"));
  auto m = ModelFile::open(dir.file("weights.safetensors"));
  EXPECT_EQ(m->metadata()["model_type"], "llama");
  EXPECT_EQ(m->tokenizer_json_path(), dir.file("tokenizer.json"));
}

TEST(Safetensors, ShardedFixtureFromTheSafetensorsPackage) {
  const std::string dir = (kData / "hf_tiny").string();
  auto m = ModelFile::open(dir);
  EXPECT_EQ(m->format(), FileFormat::Safetensors);
  EXPECT_EQ(m->path(), dir);
  EXPECT_EQ(m->metadata()["model_type"], "llama");
  EXPECT_EQ(m->metadata()["hidden_size"], 8);
  EXPECT_EQ(m->tokenizer_json_path(), (kData / "hf_tiny" / "tokenizer.json").string());
  ASSERT_EQ(m->tensors().size(), 3u);
  EXPECT_EQ(m->get("model.embed_tokens.weight").shape, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(m->get("lm_head.weight").type, TensorType::F32);
  const TensorInfo& norm = m->get("model.norm.weight");
  EXPECT_EQ(norm.type, TensorType::F16);
  const auto v = dequantized(norm);  // np.linspace(-1, 1, 8) in f16
  ASSERT_EQ(v.size(), 8u);
  EXPECT_EQ(v[0], -1.0f);
  EXPECT_EQ(v[7], 1.0f);
  EXPECT_EQ(v[4], tessera::f16_to_f32(tessera::f32_to_f16(1.0f / 7.0f)));
}

TEST(Safetensors, DirectoryWithoutIndexReadsEveryShard) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  write_file(dir.file("b.safetensors"),
             safetensors_bytes(R"({"y": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                               floats_bytes({2})));
  write_file(dir.file("a.safetensors"),
             safetensors_bytes(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                               floats_bytes({1})));
  auto m = ModelFile::open(dir.path().string());
  ASSERT_EQ(m->tensors().size(), 2u);
  EXPECT_EQ(m->tensors()[0].name, "x");
  EXPECT_EQ(m->tensors()[1].name, "y");
  EXPECT_EQ(m->tokenizer_json_path(), std::nullopt);
}

// ---- safetensors: bad inputs, one test each
// ----------------------------------------------------------------------

TEST(SafetensorsErrors, TooShort) {
  EXPECT_EQ(safetensors_error({1, 2, 3}),
            "model.safetensors: file is truncated: it has 3 bytes, too few for the 8-byte safetensors header "
            "length");
}

TEST(SafetensorsErrors, HeaderLengthPastEnd) {
  RawFile f;
  f.u64(1000).bytes("{}", 2);
  EXPECT_EQ(safetensors_error(f.b),
            "model.safetensors: header length 1000 runs past the end of the file (size 10)");
}

TEST(SafetensorsErrors, HeaderLongerThanTheFormatAllows) {
  // A sparse 100 MB file: cheap to create, and the header length check must fire before anything is parsed.
  TempDir dir;
  const std::string path = dir.file("big.safetensors");
  const uint64_t len = 100'000'001;
  write_file(path, &len, 8);
  ASSERT_EQ(truncate(path.c_str(), static_cast<off_t>(len + 8)), 0);
  EXPECT_EQ(error_of([&] { ModelFile::open(path); }),
            path + ": header length 100000001 exceeds the safetensors limit of 100000000 bytes");
}

TEST(SafetensorsErrors, InvalidJson) {
  EXPECT_EQ(safetensors_error(safetensors_bytes(R"({"a": )", {})),
            "model.safetensors: the header is not valid JSON (parse error at byte 7)");
}

TEST(SafetensorsErrors,
     NumberTooLargeForJson) {  // found by the fuzzer: nlohmann throws out_of_range, not parse_error
  EXPECT_EQ(safetensors_error(safetensors_bytes("1e999", {})),
            "model.safetensors: the header is not valid JSON (number overflow parsing '1e999')");
}

TEST(SafetensorsErrors, HeaderNotAnObject) {
  EXPECT_EQ(safetensors_error(safetensors_bytes("[1, 2]", {})),
            "model.safetensors: the header is not a JSON object");
}

TEST(SafetensorsErrors, EntryNotAnObject) {
  EXPECT_EQ(safetensors_error(safetensors_bytes(R"({"w": 3})", {})),
            "model.safetensors: tensor w: header entry is not a JSON object");
}

TEST(SafetensorsErrors, MissingDtype) {
  EXPECT_EQ(safetensors_error(safetensors_bytes(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", {})),
            "model.safetensors: tensor w: header entry has no string \"dtype\"");
}

TEST(SafetensorsErrors, BadShape) {
  EXPECT_EQ(safetensors_error(
                safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", {})),
            "model.safetensors: tensor w: header entry has no \"shape\" array of integers");
}

TEST(SafetensorsErrors, BadDataOffsets) {
  EXPECT_EQ(
      safetensors_error(
          safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", {})),
      "model.safetensors: tensor w: header entry has no \"data_offsets\" pair of non-negative integers");
}

TEST(SafetensorsErrors, UnsupportedDtype) {
  EXPECT_EQ(
      safetensors_error(safetensors_bytes(R"({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})",
                                          std::vector<uint8_t>(8))),
      "model.safetensors: tensor w has dtype I64, which tessera does not read (it reads F32, F16 and BF16)");
}

TEST(SafetensorsErrors, ZeroDimension) {
  EXPECT_EQ(safetensors_error(
                safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [4, 0], "data_offsets": [0, 0]}})", {})),
            "model.safetensors: tensor w has dimension 1 of size 0 (dimensions must be at least 1)");
}

TEST(SafetensorsErrors, ShapeOverflow) {
  EXPECT_EQ(safetensors_error(safetensors_bytes(
                R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", {})),
            "model.safetensors: tensor w has shape [4294967296, 4294967296], whose element count overflows "
            "64 bits");
}

TEST(SafetensorsErrors, OffsetsInconsistentWithShape) {
  EXPECT_EQ(
      safetensors_error(safetensors_bytes(
          R"({"w": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 8]}})", std::vector<uint8_t>(16))),
      "model.safetensors: tensor w has data_offsets [0, 8], but F16 with shape [2, 3] needs 12 bytes");
}

TEST(SafetensorsErrors, OffsetsPastEnd) {
  EXPECT_EQ(
      safetensors_error(safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                                          std::vector<uint8_t>(16))),
      "model.safetensors: tensor w has data_offsets [8, 24], past the end of the data buffer (16 bytes)");
}

TEST(SafetensorsErrors, OverlappingTensors) {
  EXPECT_EQ(
      safetensors_error(safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                          std::vector<uint8_t>(16))),
      "model.safetensors: tensors a and b overlap in the data buffer");
}

TEST(SafetensorsErrors, EmptyTensorName) {
  EXPECT_EQ(safetensors_error(safetensors_bytes(
                R"({"": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", std::vector<uint8_t>(8))),
            "model.safetensors: the header has a tensor with an empty name");
}

TEST(HFDirectoryErrors, MissingConfig) {
  TempDir dir;
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.path().string() + ": no config.json (a Hugging Face model directory needs one)");
}

TEST(HFDirectoryErrors, InvalidConfig) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{\"hidden_size\": 8,}"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.file("config.json") + ": the file is not valid JSON (parse error at byte 19)");
}

TEST(HFDirectoryErrors, ConfigNotAnObject) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("[]"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.file("config.json") + ": is not a JSON object");
}

TEST(HFDirectoryErrors, NoWeights) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.path().string() + ": no *.safetensors files (and no model.safetensors.index.json)");
}

TEST(HFDirectoryErrors, IndexWithoutWeightMap) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  write_file(dir.file("model.safetensors.index.json"), std::string(R"({"metadata": {}})"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.file("model.safetensors.index.json") +
                ": has no \"weight_map\" object of tensor name -> shard file");
}

TEST(HFDirectoryErrors, MissingShard) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  write_file(dir.file("model.safetensors.index.json"),
             std::string(R"({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.file("model.safetensors.index.json") +
                ": shard model-00002-of-00002.safetensors (of tensor lm_head.weight) does not exist");
}

TEST(HFDirectoryErrors, ShardOutsideTheDirectory) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  write_file(dir.file("model.safetensors.index.json"),
             std::string(R"({"weight_map": {"w": "../other.safetensors"}})"));
  EXPECT_EQ(
      error_of([&] { ModelFile::open(dir.path().string()); }),
      dir.file("model.safetensors.index.json") +
          ": shard name \"../other.safetensors\" (of tensor w) is not a file name in the model directory");
}

TEST(HFDirectoryErrors, IndexNamesATensorTheShardLacks) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  write_file(dir.file("s.safetensors"),
             safetensors_bytes(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                               floats_bytes({1})));
  write_file(dir.file("model.safetensors.index.json"),
             std::string(R"({"weight_map": {"x": "s.safetensors", "y": "s.safetensors"}})"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.file("model.safetensors.index.json") +
                ": names tensor y in shard s.safetensors, which does not hold it");
}

TEST(HFDirectoryErrors, TensorInTwoShards) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  for (const char* name : {"a.safetensors", "b.safetensors"}) {
    write_file(dir.file(name),
               safetensors_bytes(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                                 floats_bytes({1})));
  }
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.path().string() + ": duplicate tensor name x");
}

TEST(HFDirectoryErrors, BadShardNamesItsFile) {
  TempDir dir;
  write_file(dir.file("config.json"), std::string("{}"));
  write_file(dir.file("model.safetensors"), std::string("short"));
  EXPECT_EQ(error_of([&] { ModelFile::open(dir.path().string()); }),
            dir.file("model.safetensors") +
                ": file is truncated: it has 5 bytes, too few for the 8-byte safetensors header length");
}

// ---- inputs found by the fuzzer
// ----------------------------------------------------------------------------------

TEST(FuzzFindings, EveryCrashInputIsNowAnError) {
  // Each input tests/fuzz found (a crash, or another exception type), and the exact error it now gives; a new
  // file in the folder must be added here.
  const std::map<std::string, std::string> expected = {
      {"gguf-empty-tensor-name.bin", "tensor info 0 has an empty name"},
      {"safetensors-empty-tensor-name.bin", "the header has a tensor with an empty name"},
      {"safetensors-number-overflow-exponent.bin",
       "the header is not valid JSON (number overflow parsing "
       "'66666666666666666e666666666660000000000000000000000000000')"},
      {"safetensors-number-overflow-header.bin",
       "the header is not valid JSON (number overflow parsing '666E666666666666')"},
  };
  const fs::path dir = kData / "fuzz";
  int n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const std::string path = entry.path().string();
    const auto it = expected.find(name);
    ASSERT_NE(it, expected.end()) << path << ": add the error it gives to this test";
    auto file = MappedFile::open(path);
    if (name.rfind("gguf-", 0) == 0) {
      EXPECT_EQ(error_of([&] { read_gguf(file); }), path + ": " + it->second);
    } else {
      EXPECT_EQ(error_of([&] { parse_safetensors(*file); }), path + ": " + it->second);
    }
    ++n;
  }
  EXPECT_EQ(n, static_cast<int>(expected.size()));
}

// ---- the real models (fetched by scripts/fetch_models.sh; skipped when absent)
// ----------------------------------

std::string model_path(const std::string& file) {
  const char* env = std::getenv("TESSERA_MODELS");
  const char* home = std::getenv("HOME");
  const fs::path dir =
      env != nullptr ? fs::path(env) : fs::path(home != nullptr ? home : "/") / ".cache/tessera/models";
  return (dir / file).string();
}

// Opens the model and dequantizes every tensor; returns tensor counts per type.
std::map<std::string, int> check_every_tensor(const ModelFile& m) {
  std::map<std::string, int> types;
  std::vector<float> buf;
  for (const TensorInfo& t : m.tensors()) {
    ++types[std::string(tensor_type_name(t.type))];
    buf.resize(static_cast<size_t>(t.numel()));
    dequantize(t, buf.data());
    size_t bad = 0;
    for (float v : buf) bad += std::isfinite(v) ? 0 : 1;
    EXPECT_EQ(bad, 0u) << t.name;
  }
  return types;
}

TEST(RealModels, SmolLM2) {
  const std::string path = model_path("smollm2-135m-instruct-q4_1.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << path << " not present (run scripts/fetch_models.sh)";
  auto m = ModelFile::open(path);
  const json& md = m->metadata();
  EXPECT_EQ(md["general.architecture"], "llama");
  EXPECT_EQ(md["llama.context_length"], 8192);
  EXPECT_EQ(md["llama.block_count"], 30);
  EXPECT_EQ(md["llama.embedding_length"], 576);
  EXPECT_EQ(md["llama.attention.head_count"], 9);
  EXPECT_EQ(md["llama.attention.head_count_kv"], 3);
  EXPECT_EQ(md["llama.rope.freq_base"].get<float>(), 100000.0f);
  EXPECT_EQ(md["tokenizer.ggml.model"], "gpt2");
  EXPECT_EQ(md["tokenizer.ggml.tokens"].size(), 49152u);
  EXPECT_EQ(md["tokenizer.ggml.merges"].size(), 48900u);
  EXPECT_EQ(m->tensors().size(), 272u);
  const TensorInfo& emb = m->get("token_embd.weight");
  EXPECT_EQ(emb.type, TensorType::Q8_0);
  EXPECT_EQ(emb.shape, (std::vector<int64_t>{49152, 576}));
  const auto types = check_every_tensor(*m);
  EXPECT_EQ(types, (std::map<std::string, int>{{"F32", 61}, {"Q4_1", 210}, {"Q8_0", 1}}));
}

TEST(RealModels, Gemma3) {
  const std::string path = model_path("gemma-3-270m-q4_k_m.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << path << " not present (run scripts/fetch_models.sh)";
  auto m = ModelFile::open(path);
  const json& md = m->metadata();
  EXPECT_EQ(md["general.architecture"], "gemma3");
  EXPECT_EQ(md["gemma3.context_length"], 32768);
  EXPECT_EQ(md["gemma3.block_count"], 18);
  EXPECT_EQ(md["gemma3.embedding_length"], 640);
  EXPECT_EQ(md["gemma3.attention.sliding_window"], 512);
  EXPECT_EQ(md["gemma3.attention.key_length"], 256);
  EXPECT_EQ(md["tokenizer.ggml.model"], "llama");
  EXPECT_EQ(md["tokenizer.ggml.tokens"].size(), 262144u);
  EXPECT_EQ(md["tokenizer.ggml.scores"].size(), 262144u);
  EXPECT_EQ(m->tensors().size(), 236u);
  const TensorInfo& emb = m->get("token_embd.weight");
  EXPECT_EQ(emb.type, TensorType::Q8_0);
  EXPECT_EQ(emb.shape, (std::vector<int64_t>{262144, 640}));
  const auto types = check_every_tensor(*m);
  EXPECT_EQ(types, (std::map<std::string, int>{
                       {"F32", 109}, {"Q4_K", 27}, {"Q5_0", 81}, {"Q6_K", 9}, {"Q8_0", 10}}));
}

}  // namespace

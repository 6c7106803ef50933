// Helpers shared by the libFuzzer harnesses in tests/fuzz: a scratch directory per process, inputs that stand
// for several files, GGUF metadata from JSON, and the text samples the tokenizer harnesses encode.
//
// Multi-file inputs: a harness that reads a folder (a Hugging Face model directory, tokenizer.json beside its
// tokenizer_config.json) takes one input made of sections, each starting with a line "#file:<name>\n" and
// running to the next such line. Bytes before the first marker belong to the harness's default file. Names
// are taken from a fixed list (anything else is ignored), so the fuzzer cannot write outside the scratch
// directory. scripts/fuzz.sh builds the seeds in this layout from tests/data (tests/fuzz/make_seeds.py).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace tessera::fuzz {

// A directory of this process under $TMPDIR (default /tmp), emptied before each input and removed at exit.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::filesystem::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") /
            ("tessera-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(std::string_view name) const { return (path_ / name).string(); }

  // Removes every file in the directory (the previous input's).
  void clear() const {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(path_, ec))
      std::filesystem::remove(entry, ec);
  }

  // Writes `bytes` to `name` in the directory; returns its path.
  std::string write(std::string_view name, std::string_view bytes) const {
    const std::string p = file(name);
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

 private:
  std::filesystem::path path_;
};

// Splits an input into named sections (see the file comment). Sections with a name outside `allowed` are
// dropped; a name given twice keeps its last section.
inline std::map<std::string, std::string_view> split_files(std::string_view input,
                                                           std::string_view default_name,
                                                           std::initializer_list<std::string_view> allowed) {
  constexpr std::string_view kMarker = "#file:";
  std::map<std::string, std::string_view> files;
  std::string name(default_name);
  size_t pos = 0;
  while (true) {
    size_t next = input.find(kMarker, pos);
    while (next != std::string_view::npos && next != 0 && input[next - 1] != '\n')
      next = input.find(kMarker, next + 1);
    const size_t end = next == std::string_view::npos ? input.size() : next;
    // The newline that precedes a marker belongs to the marker.
    const size_t body_end =
        next != std::string_view::npos && end > pos && input[end - 1] == '\n' ? end - 1 : end;
    if (!(pos == 0 && end == 0)) {
      for (std::string_view a : allowed) {
        if (a == name) files[name] = input.substr(pos, body_end - pos);
      }
    }
    if (next == std::string_view::npos) break;
    const size_t line_end = input.find('\n', next);
    if (line_end == std::string_view::npos) break;  // a marker line without its newline ends the input
    name = std::string(input.substr(next + kMarker.size(), line_end - next - kMarker.size()));
    pos = line_end + 1;
  }
  return files;
}

// GGUF metadata as ModelFile::metadata() holds it, from a JSON document: only what a GGUF file can hold (an
// object whose values are numbers, bools, strings and arrays of them; false otherwise), and with every '~' in
// a string turned into the byte 0xFF, since GGUF strings are raw bytes that need not be UTF-8 (JSON text
// cannot say that).
inline bool gguf_metadata(nlohmann::json& j) {
  if (!j.is_object()) return false;
  auto fix = [](auto& self, nlohmann::json& v) -> bool {
    if (v.is_array()) {
      for (nlohmann::json& e : v)
        if (!self(self, e)) return false;
      return true;
    }
    if (v.is_string()) {
      for (char& c : v.get_ref<std::string&>())
        if (c == '~') c = '\xFF';
      return true;
    }
    return v.is_number() || v.is_boolean();
  };
  for (auto& [key, value] : j.items())
    if (!fix(fix, value)) return false;
  return true;
}

// Text the tokenizer harnesses encode besides the input's own: ASCII, digits, whitespace runs, multi-byte and
// invalid UTF-8, and the special-token spellings of the supported families.
inline constexpr std::string_view kSampleTexts[] = {
    "Hello, world! 123 4567",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80 e\xCC\x81",
    "bad utf-8: \xFF\xFE \xC3 \xE2\x82 \xF0\x9F\x98",
    "<|im_start|>user\nHi<|im_end|><|eot_id|><start_of_turn>model\n<end_of_turn>[INST] x [/INST]<s></s><unk>",
};

}  // namespace tessera::fuzz

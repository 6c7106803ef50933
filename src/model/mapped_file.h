// tessera/model/mapped_file.h — a read-only, memory-mapped file (or an in-memory stand-in for one).
//
// Model weights are never copied: the loaders hand out pointers into the mapping, which stays valid for as
// long as the MappedFile lives (ModelFile keeps its mappings alive through shared_ptr). Pages are loaded
// lazily by the kernel on first touch, so opening a multi-GiB file is cheap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/buffer.h"

namespace tessera::model {

class MappedFile {
 public:
  // Maps `path` read-only. Throws tessera::Error("<path>: cannot open: <strerror>") when the file cannot be
  // opened, stat'ed or mapped, and "<path>: not a regular file" for directories and devices. An empty file
  // maps to size() == 0 and data() == nullptr.
  static std::shared_ptr<const MappedFile> open(const std::string& path);
  // A copy of `bytes` (64-byte aligned) that behaves like a mapped file named `path` (tests, fuzzing, files
  // built in memory).
  static std::shared_ptr<const MappedFile> from_bytes(std::string path, const void* bytes, size_t size);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;  // data_ came from mmap and is released with munmap
  Buffer copy_;          // backing store of from_bytes(), 64-byte aligned like a mapping
};

}  // namespace tessera::model

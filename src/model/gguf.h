// tessera/model/gguf.h — the GGUF reader (versions 2 and 3, little-endian).
//
// File layout (GGUF specification): magic "GGUF", uint32 version, uint64 tensor count, uint64 key/value
// count; the key/values (string key, uint32 type, value); the tensor infos (string name, uint32 n_dims, int64
// ne[n_dims] innermost first, uint32 ggml type, uint64 offset into the data section); padding to the
// alignment (general.alignment, default 32); the data section. Strings are a uint64 byte length and the
// bytes, without a terminator; arrays are a uint32 element type, a uint64 count and the elements.
//
// The reader checks everything against the file size before it allocates or reads, so a hostile or truncated
// file is a tessera::Error, never a crash or a huge allocation.
#pragma once

#include <memory>

#include "model/mapped_file.h"
#include "model/model_file.h"

namespace tessera::model {

inline constexpr uint32_t kGGUFDefaultAlignment = 32;

// True when the file starts with the GGUF magic.
bool looks_like_gguf(const MappedFile& file);

// Parses `file` (errors name file->path()). The result's tensors point into the file, which it keeps alive.
ModelFile::Contents read_gguf(std::shared_ptr<const MappedFile> file);

}  // namespace tessera::model

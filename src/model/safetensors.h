// tessera/model/safetensors.h — safetensors files and Hugging Face model directories.
//
// A .safetensors file is a little-endian uint64 N, an N-byte JSON header, then the data buffer. The header
// maps each tensor name to {"dtype": "F32"|"F16"|"BF16"|..., "shape": [outermost first], "data_offsets":
// [begin, end)} with offsets relative to the data buffer; an optional "__metadata__" object holds string
// pairs. tessera reads F32, F16 and BF16 tensors; any other dtype is an Error naming the tensor.
//
// A Hugging Face directory holds config.json (required: it is the model's metadata) and its weights: the
// shards named by model.safetensors.index.json ({"weight_map": {tensor: shard file}}), or else every
// *.safetensors file in the directory, read in name order.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/mapped_file.h"
#include "model/model_file.h"

namespace tessera::model {

// The tensors of one safetensors file, in data-offset order, pointing into `file` (which the caller keeps
// alive). Errors name file.path().
std::vector<TensorInfo> parse_safetensors(const MappedFile& file);

// A single .safetensors file; metadata is the config.json in the same directory when there is one, else {}.
ModelFile::Contents read_safetensors_file(std::shared_ptr<const MappedFile> file);

// A Hugging Face model directory.
ModelFile::Contents read_hf_directory(const std::string& dir);

}  // namespace tessera::model

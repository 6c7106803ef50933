// tessera/runtime/cuda/synthetic_config.h — model configurations for benchmarks without weight files.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model_config.h"

namespace tessera::runtime::gpu {

// The config.json of a known model, as published (no weights): "llama3-8b" is Llama-3.1-8B (32 layers,
// hidden 4096, 32 query / 8 kv heads of 128, FFN 14336, vocab 128256, context 131072, RoPE theta 500000 with
// llama3 scaling, factor 8). Throws tessera::Error for other names, listing the known ones.
nlohmann::json synthetic_hf_config(const std::string& name);

// The ModelConfig of synthetic_hf_config(name), read by the same parser as a real config.json.
ModelConfig synthetic_config(const std::string& name);

std::vector<std::string> synthetic_config_names();

}  // namespace tessera::runtime::gpu

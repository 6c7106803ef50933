// tessera/attention/pattern/presets.h — attention policies from a short command-line spec.
//
//   dense                                  full attention everywhere
//   ashape[:sink=1024,local=4096]          A-shape / StreamingLLM on every head
//   triangle[:sink=8,local=512,last=128]   Triangle on every head
//   vs[:v=1000,s=6096,last_q=64]           vertical-slash on every head   (alias: minference)
//   bs[:top_k=100,block=64]                block-sparse on every head
//   moa[:alpha=0,beta=0.5,sink=64]         one MoA elastic window on every head
//   trianglemix[:start=L/2,inner=dense|vs,sink=8,local=512,last=128,v=1000,s=6096]
//                                          layers < start run `inner`, deeper layers Triangle (0-based start)
//   <path>                                 a policy file: tessera JSON, MInference per-head config, MoA alphas/betas
//
// Omitted parameters take the papers' defaults (the struct defaults in pattern.h). Errors are tessera::Error
// naming the spec and the offending key: "attention spec 'vs:x=3': unknown parameter 'x' (known: v, s, last_q)".
#pragma once

#include <string>

#include "attention/pattern/config_io.h"
#include "attention/pattern/policy.h"

namespace tessera::attn {

AttentionPolicy policy_from_spec(const std::string& spec, const PolicyShape& shape);

// Checks a spec before any model is loaded (the CLI calls it first): the preset's name, parameters and ranges, or
// the policy file's existence and contents. What depends on the model (its layer and head counts) is checked again
// by policy_from_spec. Throws the errors policy_from_spec would.
void check_policy_spec(const std::string& spec);

}  // namespace tessera::attn

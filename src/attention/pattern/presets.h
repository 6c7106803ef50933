// tessera/attention/pattern/presets.h — attention policies from a short command-line spec.
//
//   dense                                  full attention everywhere
//   ashape[:sink=1024,local=4096]          A-shape / StreamingLLM on every head
//   triangle[:sink=8,local=512,last=128]   Triangle on every head
//   vs[:v=1000,s=6096,last_q=64]           vertical-slash on every head   (alias: minference)
//   vs_adaptive[:gamma=0.9,v=1000,s=6096,min_v=0,min_s=0,last_q=64]
//                                          vertical-slash with adaptive budgets (pattern.h): per head and prompt
//                                          the fewest columns / diagonals whose estimated attention mass reaches
//                                          gamma in (0, 1], between min_v..v and min_s..s
//   bs[:top_k=100,block=64]                block-sparse on every head
//   bs_adaptive[:gamma=0.9,top_k=100,min_top_k=1,block=64]
//                                          block-sparse with adaptive budgets: per query block the fewest key
//                                          blocks whose pooled softmax mass reaches gamma, min_top_k..top_k
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

// gamma of vs_adaptive / bs_adaptive when the spec gives none.
inline constexpr double kDefaultAdaptiveGamma = 0.9;

AttentionPolicy policy_from_spec(const std::string& spec, const PolicyShape& shape);

// The presets policy_from_spec knows (the name before any ':'; "streaming" is ashape's other name), and their list
// as error messages print it: "dense, ashape, triangle, vs, vs_adaptive, minference, bs, bs_adaptive, moa,
// trianglemix".
bool is_preset_name(const std::string& name);
const char* preset_list();

// Checks a spec before any model is loaded (the CLI calls it first): the preset's name, parameters and ranges, or
// the policy file's existence and contents. What depends on the model (its layer and head counts) is checked again
// by policy_from_spec. Throws the errors policy_from_spec would.
void check_policy_spec(const std::string& spec);

}  // namespace tessera::attn

// tessera/python/policy_handle.h — tessera.Policy, and one layer's patterns as the ops take them (a JSON
// string).
//
// The torch ops take a layer's policy as a string (torch.library schemas hold strings, not C++ objects): a
// one-layer policy in tessera's JSON (Policy.layer_json), or a --attn preset such as "vs:v=64,s=256", applied
// to every head. parse_layer() caches the result per (string, heads) so that repeated calls cost a hash
// lookup.
#pragma once

#include <string>
#include <vector>

#include "attention/pattern/config_io.h"
#include "attention/pattern/policy.h"
#include "cli/session.h"

namespace tessera::python {

struct PolicyHandle {
  attn::AttentionPolicy
      policy;  // never the empty table: "dense" is a uniform dense table of the model's shape

  static PolicyHandle from_spec(const std::string& spec, const attn::PolicyShape& shape);
  static PolicyHandle from_json(const std::string& text, const std::string& source);
  static PolicyHandle for_session(const cli::Session& s, const std::string& spec);

  const attn::Pattern& at(int layer, int q_head) const;
  std::string layer_json(int layer) const;
  bool layer_is_dense(int layer) const;
};

// The patterns of one layer (one per query head) from `policy`: a one-layer policy JSON (starts with '{'), or
// a preset spec for every head. The layer's query and KV head counts must match (num_q_heads, num_kv_heads).
// Throws tessera::Error with the spec's or the JSON's message.
std::vector<attn::Pattern> parse_layer(const std::string& policy, int num_q_heads, int num_kv_heads);

}  // namespace tessera::python

// tessera/server/policy_cache.h — attention policies by the spec a request names, built once each.
//
// A request picks its policy with "tessera": {"attn": SPEC}. SPEC is a preset spec as for the CLI's --attn
// (dense, ashape[:...], triangle[:...], vs|minference[:...], bs[:...], moa[:...], trianglemix[:...]) or the name
// of a policy file (a "plan") in the server's --policy-dir: NAME or NAME.json there. Requests never name a
// path: a client must not make the server read files of its choosing. The server's own --attn may be any spec
// the CLI takes, a path included; it is what a request without "tessera.attn" gets.
//
// Thread-safe. Errors for a request's spec are ApiError 400 with param "tessera.attn"; the server's default
// spec is checked at construction (tessera::Error, before the server listens).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "attention/pattern/config_io.h"
#include "attention/pattern/policy.h"

namespace tessera::server {

class PolicyCache {
 public:
  PolicyCache(attn::PolicyShape shape, std::string default_spec, std::string policy_dir);

  // The policy for a request's spec; "" gives the server's default.
  std::shared_ptr<const attn::AttentionPolicy> get(const std::string& spec);
  const std::string& default_spec() const { return default_spec_; }
  // Every request runs dense attention within another memory (serve --stream): a request naming a spec other than
  // "dense" gets 400 "'tessera.attn' is 'SPEC': <why>", and the request lines name `label` ("stream:ltri").
  void only_dense(std::string why, std::string label) {
    only_dense_ = std::move(why);
    label_ = std::move(label);
  }
  // What a request without "tessera.attn" runs, for the request lines.
  const std::string& default_label() const { return label_.empty() ? default_spec_ : label_; }

 private:
  attn::AttentionPolicy build(const std::string& spec) const;

  attn::PolicyShape shape_;
  std::string default_spec_, policy_dir_, only_dense_, label_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<const attn::AttentionPolicy>> cache_;
};

// At most this many distinct specs are kept (others are built per request), so clients cannot grow the cache.
inline constexpr size_t kMaxCachedPolicies = 64;

}  // namespace tessera::server

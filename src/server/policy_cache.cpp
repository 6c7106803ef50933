#include "server/policy_cache.h"

#include <cctype>
#include <filesystem>

#include "attention/pattern/presets.h"
#include "core/error.h"
#include "server/api_request.h"

namespace tessera::server {

namespace {

bool is_preset(const std::string& spec) { return attn::is_preset_name(spec.substr(0, spec.find(':'))); }

bool is_plan_name(const std::string& s) {
  if (s.empty() || s[0] == '.') return false;
  for (const char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

}  // namespace

PolicyCache::PolicyCache(attn::PolicyShape shape, std::string default_spec, std::string policy_dir)
    : shape_(shape), default_spec_(std::move(default_spec)), policy_dir_(std::move(policy_dir)) {
  if (!policy_dir_.empty())
    check(std::filesystem::is_directory(policy_dir_), "--policy-dir " + policy_dir_ + ": not a directory");
  // The operator's spec may be a path (as for `tessera run --attn`).
  auto policy = default_spec_ == "dense" ? attn::AttentionPolicy{} : attn::policy_from_spec(default_spec_, shape_);
  cache_.emplace("", std::make_shared<const attn::AttentionPolicy>(std::move(policy)));
}

attn::AttentionPolicy PolicyCache::build(const std::string& spec) const {
  if (spec == "dense") return {};
  if (is_preset(spec)) return attn::policy_from_spec(spec, shape_);
  if (!is_plan_name(spec))
    throw invalid_request("'tessera.attn' is '" + spec + "': not a preset (" + attn::preset_list() +
                              ") nor a plan name (letters, digits, '.', '_', '-'); requests cannot name file paths",
                          "tessera.attn");
  if (policy_dir_.empty())
    throw invalid_request("'tessera.attn' is '" + spec + "': not a preset (" + attn::preset_list() +
                              "), and this server has no --policy-dir to find plans in",
                          "tessera.attn");
  for (const std::string& file : {policy_dir_ + "/" + spec, policy_dir_ + "/" + spec + ".json"})
    if (std::filesystem::is_regular_file(file)) return attn::policy_from_spec(file, shape_);
  throw invalid_request("'tessera.attn' is '" + spec + "': no such preset, and no plan " + spec + " or " + spec +
                            ".json in the server's --policy-dir",
                        "tessera.attn");
}

std::shared_ptr<const attn::AttentionPolicy> PolicyCache::get(const std::string& spec) {
  if (!only_dense_.empty() && !spec.empty() && spec != "dense")
    throw invalid_request("'tessera.attn' is '" + spec + "': " + only_dense_, "tessera.attn");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = cache_.find(spec); it != cache_.end()) return it->second;
  }
  std::shared_ptr<const attn::AttentionPolicy> policy;
  try {
    policy = std::make_shared<const attn::AttentionPolicy>(build(spec));
  } catch (const Error& e) {
    throw invalid_request(std::string("'tessera.attn': ") + e.what(), "tessera.attn");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (cache_.size() < kMaxCachedPolicies) cache_.emplace(spec, policy);
  return policy;
}

}  // namespace tessera::server

// Policy files (config_io.h): which of the three formats a document is, the model-shape checks, and reading
// and writing files. The formats themselves: policy_json.cpp (tessera), minference_io.cpp, moa_io.cpp; the
// text layout: policy_text.cpp; what they share: config_json.h.
#include "attention/pattern/config_io.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <tuple>

#include "attention/pattern/config_json.h"
#include "core/enum_names.h"
#include "core/error.h"

namespace tessera::attn {

using namespace config_detail;

namespace {

// The head count of layer 0 of a foreign file, when it can be seen; 1 otherwise (the import then reports the
// structural problem).
int peek_q_heads(const json& j, PolicyFormat format) {
  const json* layer0 = nullptr;
  if (format == PolicyFormat::minference && j.is_array() && !j.empty()) layer0 = &j[0];
  if (format == PolicyFormat::moa) {
    const json* a = find(j, "alphas");
    if (a && a->is_array() && !a->empty()) layer0 = &(*a)[0];
  }
  if (!layer0 || !(layer0->is_object() || layer0->is_array()) || layer0->empty()) return 1;
  return static_cast<int>(layer0->size());
}

}  // namespace

PolicyShape shape_of(const AttentionPolicy& policy) {
  return {policy.num_layers(), policy.num_q_heads(), policy.num_kv_heads()};
}

std::string_view format_name(PolicyFormat format) {
  static constexpr std::string_view kNames[] = {"tessera", "minference", "moa"};  // in PolicyFormat's order
  return enum_name(kNames, format);
}

PolicyFormat detect_policy_format(const json& j, const std::string& source) {
  if (j.is_object() && j.contains("tessera_policy")) return PolicyFormat::tessera;
  if (j.is_array()) return PolicyFormat::minference;
  if (j.is_object() && (j.contains("alphas") || j.contains("betas"))) return PolicyFormat::moa;
  throw Error(
      source +
      ": not a policy file: expected a tessera policy (an object with \"tessera_policy\"), a MInference "
      "config (a list over layers) or a MoA plan (an object with \"alphas\" and \"betas\"), got " +
      (j.is_object() ? std::string("an object without those keys") : "a " + std::string(j.type_name())));
}

void check_policy_shape(const AttentionPolicy& policy, const PolicyShape& expected,
                        const std::string& source) {
  if (policy.num_layers() != expected.num_layers)
    throw Error(layer_count_mismatch(static_cast<size_t>(policy.num_layers()), expected.num_layers, source));
  if (policy.num_q_heads() != expected.num_q_heads)
    throw Error(source + ": the policy has " + str(policy.num_q_heads()) +
                " query heads per layer, but the model has " + str(expected.num_q_heads));
  if (policy.num_kv_heads() != expected.num_kv_heads)
    throw Error(source + ": the policy has " + str(policy.num_kv_heads()) + " KV heads, but the model has " +
                str(expected.num_kv_heads));
}

AttentionPolicy load_policy_json(const json& j, const std::string& source,
                                 const std::optional<PolicyShape>& expected) {
  const PolicyFormat format = detect_policy_format(j, source);
  AttentionPolicy policy;
  switch (format) {
    case PolicyFormat::tessera:
      // The header's counts size the table: compare them with the model before anything is allocated.
      if (expected && j.is_object()) {
        // (The messages of check_policy_shape, which the parsed policy meets again.)
        const std::tuple<const char*, const char*, int> counts[] = {
            {"num_layers", " layers", expected->num_layers},
            {"num_q_heads", " query heads per layer", expected->num_q_heads},
            {"num_kv_heads", " KV heads", expected->num_kv_heads}};
        for (const auto& [field, unit, want] : counts) {
          const json* v = find(j, field);
          if (v && v->is_number_integer() && v->get<int64_t>() != want)
            throw Error(source + ": the policy has " + show(*v) + unit + ", but the model has " + str(want));
        }
      }
      policy = parse_tessera_policy(j, source);
      break;
    case PolicyFormat::minference:
      policy = import_minference_checked(j, source, expected ? expected->num_kv_heads : peek_q_heads(j, format),
                                      expected, nullptr);
      break;
    case PolicyFormat::moa:
      policy =
          import_moa_checked(j, source, expected ? expected->num_kv_heads : peek_q_heads(j, format), expected);
      break;
  }
  if (expected) check_policy_shape(policy, *expected, source);
  return policy;
}

AttentionPolicy load_policy_file(const std::filesystem::path& path,
                                 const std::optional<PolicyShape>& expected) {
  const std::string source = path.string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw Error(source + ": file not found");
  if (std::filesystem::is_directory(path, ec)) throw Error(source + ": is a directory, not a policy file");
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error(source + ": not a regular file (a policy is read from a JSON file, not a device or a pipe)");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(source + ": cannot read the file size: " + ec.message());
  if (size > kMaxPolicyFileBytes)
    throw Error(source + ": " + std::to_string(size) + " bytes, more than a policy file may hold (" +
                std::to_string(kMaxPolicyFileBytes >> 20) + " MiB)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(source + ": cannot open file for reading: " + std::strerror(errno));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (in.bad() || static_cast<size_t>(in.gcount()) != size) throw Error(source + ": error while reading the file");

  json j;
  try {
    j = json::parse(text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // nlohmann's message reads "[json.exception.parse_error.101] parse error at line 3, column 5: <why>".
    std::string what = e.what();
    const size_t at = what.find("parse error at ");
    if (at != std::string::npos)
      what = what.substr(at + std::strlen("parse error "));
    else
      what = "at byte " + std::to_string(e.byte) + ": " + what;
    throw Error(source + ": invalid JSON " + what);
  } catch (const json::exception& e) {  // out_of_range 406: a number too large for a double ("1e999")
    std::string what = e.what();
    if (const size_t at = what.find("] "); at != std::string::npos) what.erase(0, at + 2);
    throw Error(source + ": invalid JSON (" + what + ")");
  }
  return load_policy_json(j, source, expected);
}

void save_policy_file(const AttentionPolicy& policy, const std::filesystem::path& path, PolicyFormat format) {
  json j;
  switch (format) {
    case PolicyFormat::tessera:
      j = save_policy_json(policy);
      break;
    case PolicyFormat::minference:
      j = export_minference(policy);
      break;
    case PolicyFormat::moa:
      j = export_moa(policy);
      break;
  }
  const std::string text = format_policy_json(j) + "\n";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(path.string() + ": cannot open file for writing: " + std::strerror(errno));
  out << text;
  out.close();
  if (!out) throw Error(path.string() + ": error while writing the file");
}

}  // namespace tessera::attn

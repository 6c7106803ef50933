#include "plan/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <variant>

#include "plan/trianglemix_plan.h"

namespace tessera::plan {

namespace {

attn::AttentionPolicy layer_policy(const attn::AttentionPolicy& policy, int32_t layer, int32_t heads) {
  std::vector<attn::Pattern> row = policy.table().empty() ? std::vector<attn::Pattern>(static_cast<size_t>(heads))
                                                          : policy.layer(layer);
  return attn::AttentionPolicy(1, heads, heads, std::move(row));
}

const attn::Pattern& pattern_at(const attn::AttentionPolicy& policy, int32_t layer, int32_t head) {
  static const attn::Pattern dense = attn::DensePattern{};
  return policy.table().empty() ? dense : policy.at(layer, head);
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else
      out += c;
  }
  return out;
}

}  // namespace

std::string plan_svg(const attn::AttentionPolicy& policy, int32_t layers, int32_t heads, int32_t length,
                     const std::string& title) {
  // Colours per pattern kind (the variant index), Okabe-Ito palette.
  static const char* colours[] = {"#555555", "#E69F00", "#009E73", "#0072B2", "#D55E00", "#CC79A7"};
  static const char* names[] = {"dense", "ashape", "moa_window", "triangle", "vertical_slash", "block_sparse"};
  const int cell = 18, left = 70, top = 40, legend = 24 * 6 + 20;
  const int width = left + heads * cell + 220, height = std::max(top + layers * cell + 40, top + legend);
  std::string s;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
                "font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                width, height);
  s += buf;
  s += "<text x=\"10\" y=\"18\" font-size=\"13\">" + escape(title) + "</text>\n";
  std::snprintf(buf, sizeof buf, "<text x=\"%d\" y=\"%d\">heads &#8594; (shade: density at %d tokens)</text>\n", left,
                top - 6, length);
  s += buf;
  std::map<std::string, double> cache;
  for (int32_t l = 0; l < layers; ++l) {
    std::snprintf(buf, sizeof buf, "<text x=\"10\" y=\"%d\">layer %d</text>\n", top + l * cell + 13, l);
    s += buf;
    for (int32_t h = 0; h < heads; ++h) {
      const attn::Pattern& p = pattern_at(policy, l, h);
      const std::string key = attn::describe(p);
      auto it = cache.find(key);
      if (it == cache.end())
        it = cache.emplace(key, policy_density(attn::AttentionPolicy(1, 1, 1, {p}), length)).first;
      const double opacity = 0.25 + 0.75 * it->second;
      std::snprintf(buf, sizeof buf,
                    "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" fill-opacity=\"%.3f\" "
                    "stroke=\"white\"><title>layer %d head %d: ",
                    left + h * cell, top + l * cell, cell, cell, colours[p.index()], opacity, l, h);
      s += buf;
      std::snprintf(buf, sizeof buf, " (density %.3f)</title></rect>\n", it->second);
      s += escape(key) + buf;
    }
  }
  for (size_t k = 0; k < 6; ++k) {
    const int x = left + heads * cell + 20, y = top + static_cast<int>(k) * 24;
    std::snprintf(buf, sizeof buf,
                  "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"14\" fill=\"%s\"/><text x=\"%d\" y=\"%d\">%s</text>\n",
                  x, y, colours[k], x + 20, y + 11, names[k]);
    s += buf;
  }
  s += "</svg>\n";
  return s;
}

double window_density(int32_t window, int32_t n) {
  if (window <= 0 || window >= n) return 1.0;
  const double w = window, N = n;
  const double cells = w * (w + 1) / 2 + (N - w) * w;  // rows 0..w-1 keep row + 1 keys, the rest w
  return cells / (N * (N + 1) / 2);
}

std::vector<LengthCost> plan_costs(const attn::AttentionPolicy& policy, int32_t layers, int32_t heads,
                                   int32_t head_dim, const std::vector<int32_t>& lengths,
                                   const std::vector<int32_t>& layer_windows) {
  const bool windows = std::any_of(layer_windows.begin(), layer_windows.end(), [](int32_t w) { return w > 0; });
  std::vector<LengthCost> out;
  for (int32_t n : lengths) {
    LengthCost c;
    c.length = n;
    if (!windows) {
      c.density = policy_density(policy, n);
    } else {
      std::map<std::string, double> of;  // a pattern's density, by describe()
      double sum = 0;
      for (int32_t l = 0; l < layers; ++l) {
        const int32_t w = static_cast<size_t>(l) < layer_windows.size() ? layer_windows[static_cast<size_t>(l)] : 0;
        for (int32_t h = 0; h < heads; ++h) {
          const attn::Pattern& p = pattern_at(policy, l, h);
          auto it = of.find(attn::describe(p));
          if (it == of.end())
            it = of.emplace(attn::describe(p), policy_density(attn::AttentionPolicy::uniform(1, 1, 1, p), n)).first;
          sum += w > 0 ? std::min(it->second, window_density(w, n)) : it->second;
        }
      }
      c.density = sum / (static_cast<double>(layers) * heads);
    }
    const double causal = static_cast<double>(n) * (n + 1) / 2;
    c.dense_flops = 4.0 * head_dim * causal * heads * layers;
    c.flops = c.density * c.dense_flops;
    out.push_back(c);
  }
  return out;
}

std::vector<std::string> layer_summary(const attn::AttentionPolicy& policy, int32_t layers, int32_t heads,
                                       int32_t length) {
  std::vector<std::string> out;
  for (int32_t l = 0; l < layers; ++l) {
    std::map<std::string, int> kinds;
    std::vector<std::string> order;
    for (int32_t h = 0; h < heads; ++h) {
      const std::string name(attn::pattern_name(pattern_at(policy, l, h)));
      if (kinds[name]++ == 0) order.push_back(name);
    }
    std::string line = "layer " + std::string(l < 10 ? " " : "") + std::to_string(l) + ":";
    for (size_t i = 0; i < order.size(); ++i)
      line += (i ? ", " : " ") + order[i] + " " + std::to_string(kinds[order[i]]);
    std::set<std::string> distinct;
    for (int32_t h = 0; h < heads; ++h) distinct.insert(attn::describe(pattern_at(policy, l, h)));
    char buf[96];
    std::snprintf(buf, sizeof buf, "  (%zu distinct)  density %.3f", distinct.size(),
                  policy_density(layer_policy(policy, l, heads), length));
    out.push_back(line + buf);
  }
  return out;
}

}  // namespace tessera::plan

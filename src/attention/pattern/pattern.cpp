#include "attention/pattern/pattern.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/overloaded.h"

namespace tessera::attn {

namespace {

std::string num(double v) {
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

thread_local const FieldNamer* t_namer = nullptr;

void require(bool ok, const std::string& where, const char* field, const std::string& rule, double got) {
  if (ok) return;
  if (t_namer != nullptr && *t_namer) throw Error(where + ": " + (*t_namer)(field) + " must be " + rule + ", got " + num(got));
  throw Error(where + ": field '" + field + "' must be " + rule + ", got " + num(got));
}
}  // namespace

int64_t ElasticWindowPattern::span(int64_t total_len) const {
  const double s = std::floor(alpha + beta * static_cast<double>(total_len));
  if (!(s > 0)) return 0;  // also catches NaN
  return std::min<int64_t>(total_len, static_cast<int64_t>(std::min(s, 9.0e18)));
}

std::string_view pattern_name(const Pattern& p) {
  return std::visit(Overloaded{[](const DensePattern&) { return std::string_view("dense"); },
                               [](const AShapePattern&) { return std::string_view("ashape"); },
                               [](const ElasticWindowPattern&) { return std::string_view("moa_window"); },
                               [](const TrianglePattern&) { return std::string_view("triangle"); },
                               [](const VerticalSlashPattern&) { return std::string_view("vertical_slash"); },
                               [](const BlockSparsePattern&) { return std::string_view("block_sparse"); }},
                    p);
}

bool is_dynamic(const Pattern& p) {
  return std::holds_alternative<VerticalSlashPattern>(p) || std::holds_alternative<BlockSparsePattern>(p);
}

bool all_dense(std::span<const Pattern> patterns) {
  return std::all_of(patterns.begin(), patterns.end(),
                     [](const Pattern& p) { return std::holds_alternative<DensePattern>(p); });
}

std::string describe(const Pattern& p) {
  return std::visit(
      Overloaded{
          [](const DensePattern&) { return std::string("dense"); },
          [](const AShapePattern& a) {
            return "ashape(sink=" + std::to_string(a.sink) + ", local=" + std::to_string(a.local) + ")";
          },
          [](const ElasticWindowPattern& e) {
            return "moa_window(alpha=" + num(e.alpha) + ", beta=" + num(e.beta) + ", sink=" + std::to_string(e.sink) +
                   ")";
          },
          [](const TrianglePattern& t) {
            return "triangle(sink=" + std::to_string(t.sink) + ", local=" + std::to_string(t.local) +
                   ", last=" + std::to_string(t.last) + ")";
          },
          [](const VerticalSlashPattern& v) {
            if (v.adaptive()) {
              return "vertical_slash(gamma=" + num(v.gamma) + ", v=" + std::to_string(v.min_vertical) + ".." +
                     std::to_string(v.vertical) + ", s=" + std::to_string(v.min_slash) + ".." +
                     std::to_string(v.slash) + ")";
            }
            return "vertical_slash(v=" + std::to_string(v.vertical) + ", s=" + std::to_string(v.slash) + ")";
          },
          [](const BlockSparsePattern& b) {
            if (b.adaptive()) {
              return "block_sparse(gamma=" + num(b.gamma) + ", top_k=" + std::to_string(b.min_top_k) + ".." +
                     std::to_string(b.top_k) + ", block=" + std::to_string(b.block) + ")";
            }
            return "block_sparse(top_k=" + std::to_string(b.top_k) + ", block=" + std::to_string(b.block) + ")";
          }},
      p);
}

void validate(const Pattern& p, const std::string& where, const FieldNamer& namer) {
  struct Scope {
    explicit Scope(const FieldNamer* n) { t_namer = n; }
    ~Scope() { t_namer = nullptr; }
  } scope(&namer);
  std::visit(Overloaded{[](const DensePattern&) {},
                        [&](const AShapePattern& a) {
                          require(a.sink >= 0, where, "sink", ">= 0", a.sink);
                          require(a.local >= 1, where, "local", ">= 1", a.local);
                        },
                        [&](const ElasticWindowPattern& e) {
                          require(std::isfinite(e.alpha), where, "alpha", "finite", e.alpha);
                          require(std::isfinite(e.beta) && e.beta >= 0, where, "beta", "finite and >= 0", e.beta);
                          require(e.sink >= 0, where, "sink", ">= 0", e.sink);
                        },
                        [&](const TrianglePattern& t) {
                          require(t.sink >= 0, where, "sink", ">= 0", t.sink);
                          require(t.local >= 1, where, "local", ">= 1", t.local);
                          require(t.last >= 0, where, "last", ">= 0", t.last);
                        },
                        [&](const VerticalSlashPattern& v) {
                          require(v.vertical >= 0, where, "vertical", ">= 0", v.vertical);
                          require(v.slash >= 0, where, "slash", ">= 0", v.slash);
                          require(v.last_q >= 1, where, "last_q", ">= 1", v.last_q);
                          require(v.forced_columns >= 0, where, "forced_columns", ">= 0", v.forced_columns);
                          require(v.forced_diagonals >= 0, where, "forced_diagonals", ">= 0", v.forced_diagonals);
                          require(v.gamma >= 0.0 && v.gamma <= 1.0, where, "gamma",
                                  "in [0, 1] (0: fixed budgets)", v.gamma);  // also catches NaN
                          if (v.adaptive()) {
                            require(v.min_vertical >= 0 && v.min_vertical <= v.vertical, where, "min_vertical",
                                    "in [0, vertical = " + std::to_string(v.vertical) + "]", v.min_vertical);
                            require(v.min_slash >= 0 && v.min_slash <= v.slash, where, "min_slash",
                                    "in [0, slash = " + std::to_string(v.slash) + "]", v.min_slash);
                          }
                        },
                        [&](const BlockSparsePattern& b) {
                          require(b.top_k >= 1, where, "top_k", ">= 1", b.top_k);
                          require(b.block >= 1, where, "block", ">= 1", b.block);
                          require(b.gamma >= 0.0 && b.gamma <= 1.0, where, "gamma",
                                  "in [0, 1] (0: fixed budgets)", b.gamma);
                          if (b.adaptive()) {
                            require(b.min_top_k >= 1 && b.min_top_k <= b.top_k, where, "min_top_k",
                                    "in [1, top_k = " + std::to_string(b.top_k) + "]", b.min_top_k);
                          }
                        }},
             p);
}

}  // namespace tessera::attn

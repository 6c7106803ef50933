#include "eval/heatmap.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/format.h"

namespace tessera::eval {

namespace {

struct Rgb {
  double r, g, b;
};

constexpr Rgb kLow{215, 48, 39};
constexpr Rgb kMid{254, 224, 139};
constexpr Rgb kHigh{26, 152, 80};

Rgb lerp(const Rgb& a, const Rgb& b, double t) {
  return {a.r + (b.r - a.r) * t, a.g + (b.g - a.g) * t, a.b + (b.b - a.b) * t};
}

Rgb colour_of(double rate) {
  const double t = std::clamp(std::isnan(rate) ? 0.0 : rate, 0.0, 1.0);
  return t < 0.5 ? lerp(kLow, kMid, t * 2) : lerp(kMid, kHigh, (t - 0.5) * 2);
}

std::string hex(const Rgb& c) {
  auto byte = [](double v) { return static_cast<int>(std::lround(std::clamp(v, 0.0, 255.0))); };
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", byte(c.r), byte(c.g), byte(c.b));
  return buf;
}

}  // namespace

std::string heat_colour(double rate) {
  return hex(colour_of(rate));
}

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string heatmap_svg(const PassGrid& grid, std::string_view title, std::string_view x_label,
                        std::string_view y_label) {
  const double cell_w = 56, cell_h = 26;
  const double left = 84, top = 48, legend_gap = 24, legend_w = 16, legend_labels = 48, bottom = 56;
  const double grid_w = cell_w * static_cast<double>(grid.cols());
  const double grid_h = cell_h * static_cast<double>(grid.rows());
  const double width = left + grid_w + legend_gap + legend_w + legend_labels;
  const double height = top + std::max(grid_h, 60.0) + bottom;

  std::string s;
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + format_g(width) + "\" height=\"" +
       format_g(height) + "\" viewBox=\"0 0 " + format_g(width) + " " + format_g(height) +
       "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  s += "<defs><linearGradient id=\"heat\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">";
  for (double t : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    s += "<stop offset=\"" + format_g(t) + "\" stop-color=\"" + heat_colour(t) + "\"/>";
  }
  s += "</linearGradient></defs>\n";
  s += "<text x=\"" + format_g(left + grid_w / 2) + "\" y=\"24\" text-anchor=\"middle\" font-size=\"14\">" +
       xml_escape(title) + "</text>\n";

  for (size_t r = 0; r < grid.rows(); ++r) {
    const double y = top + cell_h * static_cast<double>(r);
    s += "<text x=\"" + format_g(left - 6) + "\" y=\"" + format_g(y + cell_h / 2 + 4) +
         "\" text-anchor=\"end\">" + xml_escape(grid.row_labels[r]) + "</text>\n";
    for (size_t c = 0; c < grid.cols(); ++c) {
      const double x = left + cell_w * static_cast<double>(c);
      const PassRate& p = grid.at(r, c);
      const std::string fill = p.total == 0 ? "#dddddd" : heat_colour(p.rate());
      s += "<rect x=\"" + format_g(x) + "\" y=\"" + format_g(y) + "\" width=\"" + format_g(cell_w) +
           "\" height=\"" + format_g(cell_h) + "\" fill=\"" + fill + "\" stroke=\"#ffffff\"><title>" +
           xml_escape(grid.col_labels[c]) + ", depth " + xml_escape(grid.row_labels[r]) + ": " +
           xml_escape(format_rate(p)) + "</title></rect>\n";
      if (p.total > 0) {
        char pct[16];
        std::snprintf(pct, sizeof pct, "%.0f", 100.0 * p.rate());
        s += "<text x=\"" + format_g(x + cell_w / 2) + "\" y=\"" + format_g(y + cell_h / 2 + 4) +
             "\" text-anchor=\"middle\" fill=\"#000000\">" + pct + "</text>\n";
      }
    }
  }
  for (size_t c = 0; c < grid.cols(); ++c) {
    s += "<text x=\"" + format_g(left + cell_w * (static_cast<double>(c) + 0.5)) + "\" y=\"" +
         format_g(top + grid_h + 16) + "\" text-anchor=\"middle\">" + xml_escape(grid.col_labels[c]) +
         "</text>\n";
  }
  s += "<text x=\"" + format_g(left + grid_w / 2) + "\" y=\"" + format_g(top + grid_h + 40) +
       "\" text-anchor=\"middle\">" + xml_escape(x_label) + "</text>\n";
  s += "<text x=\"16\" y=\"" + format_g(top + grid_h / 2) +
       "\" text-anchor=\"middle\" transform=\"rotate(-90 16 " + format_g(top + grid_h / 2) + ")\">" +
       xml_escape(y_label) + "</text>\n";

  // Legend: a gradient bar from 0 (bottom) to 100% (top).
  const double lx = left + grid_w + legend_gap;
  const double lh = std::max(grid_h, 60.0);
  s += "<path d=\"M" + format_g(lx) + " " + format_g(top) + " h" + format_g(legend_w) + " v" + format_g(lh) +
       " h-" + format_g(legend_w) + " Z\" fill=\"url(#heat)\" stroke=\"#888888\"/>\n";
  s += "<text x=\"" + format_g(lx + legend_w + 4) + "\" y=\"" + format_g(top + 8) + "\">100%</text>\n";
  s += "<text x=\"" + format_g(lx + legend_w + 4) + "\" y=\"" + format_g(top + lh) + "\">0%</text>\n";
  s += "</svg>\n";
  return s;
}

}  // namespace tessera::eval

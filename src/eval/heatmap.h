// tessera/eval/heatmap.h — the needle-in-a-haystack figure: a length x depth grid coloured by pass rate,
// written as a self-contained SVG (no dependencies, opens in any browser).
//
// Columns are the grid's columns (context lengths, left to right), rows its rows (depths, 0% at the top), as
// in the papers' figures. Colour runs red (0) through yellow (0.5) to green (1); cells without cases are
// grey. Each cell is exactly one <rect> (with a <title> tooltip "8K, depth 50%: 66.7% (2/3)"); the colour
// legend is a <path>, so a figure of R rows and C columns has R x C rects.
#pragma once

#include <string>
#include <string_view>

#include "eval/report.h"

namespace tessera::eval {

// "#rrggbb" for a pass rate in [0, 1] (clamped).
std::string heat_colour(double rate);

// Escapes & < > " ' for XML text and attributes.
std::string xml_escape(std::string_view s);

std::string heatmap_svg(const PassGrid& grid, std::string_view title,
                        std::string_view x_label = "context length (tokens)",
                        std::string_view y_label = "needle depth");

}  // namespace tessera::eval

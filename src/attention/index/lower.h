// tessera/attention/index/lower.h — lowering of patterns to the range+column index, and their exact masks.
#pragma once

#include <vector>

#include "attention/index/estimate.h"
#include "attention/index/lowering_context.h"
#include "attention/index/sparse_index.h"
#include "attention/pattern/pattern.h"

namespace tessera::attn {

// Lowers one layer: patterns[h] (with estimates[h] for dynamic patterns, std::monostate otherwise) for every
// query head h. Throws tessera::Error when a dynamic pattern lacks its estimate or the context is inconsistent.
SparseIndex lower_layer(const std::vector<Pattern>& patterns, const std::vector<HeadEstimate>& estimates,
                        const LoweringContext& ctx);

// The same for a single head, appended to `index` (used by lower_layer; index.num_heads grows by one).
void lower_head(const Pattern& pattern, const HeadEstimate& estimate, const LoweringContext& ctx, SparseIndex& index);

// An index from pattern definitions alone, straight from the documented per-cell predicate (docs/patterns.md),
// for tests: mask[row * kv_len + key] for one head. Deliberately written without any range arithmetic.
std::vector<uint8_t> pattern_mask(const Pattern& pattern, const HeadEstimate& estimate, const LoweringContext& ctx);

}  // namespace tessera::attn

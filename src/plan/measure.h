// tessera/plan/measure.h — the attention density a policy executes on a real prompt (issue 33's table: plans beside
// presets "of the same executed density").
//
// One dense prefill of the prompt with the engine's AttentionObserver; at every layer each policy's patterns for
// that layer go through the same estimators and index build as the engine (64-row tiles), and the index's cells are
// counted: density = kept (row, key) cells / causal cells, summed over layers and query heads (a dense layer counts
// all its causal cells). For static patterns this is their exact accounting; for dynamic ones (vertical-slash,
// block-sparse, adaptive budgets) what their estimate keeps on this prompt.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/pattern/policy.h"
#include "core/thread_pool.h"
#include "model/model.h"

namespace tessera::plan {

// Per policy, the executed density on `tokens` (prefilled in one chunk). Throws tessera::Error for an empty prompt or
// a policy of another shape.
std::vector<double> executed_density(const runtime::Model& model, const std::vector<int32_t>& tokens,
                                     const std::vector<attn::AttentionPolicy>& policies, ThreadPool& pool);

}  // namespace tessera::plan

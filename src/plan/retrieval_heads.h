// tessera/plan/retrieval_heads.h — finding retrieval heads (Wu et al.), the heads Ltri-LLM's voting trusts: a
// calibration of streaming memory, beside the other planners (`tessera eval --retrieval-heads-out`).
//
// A head's retrieval score is the share of needle tokens it copies: the dense model reads a needle prompt followed
// by the answer (teacher forcing); for the query that predicts answer token i, the head "copies" when its most
// attended key is an occurrence, inside the needle, of that very token. Scores are averaged over cases, per
// (layer, query head). Streaming (runtime/stream, StreamOptions::retrieval_heads) lets the best head of each layer
// with score > 0.1 vote.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/model.h"
#include "runtime/stream/stream_options.h"

namespace tessera::plan {

using runtime::Model;
using runtime::RetrievalHead;

struct RetrievalCase {
  std::vector<int32_t> prompt;  // ends where the answer starts
  std::vector<int32_t> answer;  // the needle's tokens as the prompt holds them (found in it)
};

// Where `needle` occurs in `tokens` (the last occurrence), or -1.
int64_t find_tokens(std::span<const int32_t> tokens, std::span<const int32_t> needle);

// Scores of every (layer, query head), averaged over the cases (row-major [layer][head] as RetrievalHead values).
// Runs each case densely on the CPU. Throws tessera::Error when a case's answer is empty.
std::vector<RetrievalHead> retrieval_head_scores(const Model& model,
                                                          std::span<const RetrievalCase> cases);

// "layer head score" lines, best first (the file --stream-retrieval-heads reads).
std::string retrieval_heads_text(std::vector<RetrievalHead> heads);

}  // namespace tessera::plan

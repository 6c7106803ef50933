// tessera/runtime/stream/stream_options.h — the options of streaming memory (Ltri-LLM and its baselines).
//
// Streaming reads a prompt of any length with bounded attention memory, in InfLLM's layout (which Ltri-LLM builds
// on): each chunk of `chunk` tokens attends to
//     [sinks | retrieved blocks | local window | the chunk itself]
// where sinks are the first `sinks` tokens, the local window is the most recent n_local..n_local+block-1 tokens
// before the chunk, and retrieved blocks are `top_k` of the `block`-token blocks evicted from the local window
// (kept in host memory, runtime/stream/host_block_store.h). Which blocks are retrieved is the method:
//   streamingllm  none (sinks + window; StreamingLLM)
//   infllm        the blocks whose representative keys (the `repr_keys` most attended tokens) best match the
//                 chunk's mean query (InfLLM)
//   ltri          the blocks whose spans (triangles of the attention map, found by NMS) best match the chunk's
//                 spans, with dynamic index vectors per span, retrieval-head and collaborative voting (Ltri-LLM)
// Positions follow InfLLM: the local window and the chunk keep their true (relative) positions; sinks and
// retrieved blocks are all seen at one distance, n_local, from every query — so no query ever sees a key farther
// than n_local + block + chunk positions away, and a model reads past its trained context.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::runtime {

enum class StreamMethod { None, StreamingLLM, InfLLM, Ltri };

// "ltri" | "infllm" | "streamingllm" (and "none"); throws tessera::Error naming `what` on anything else.
StreamMethod parse_stream_method(const std::string& name, const std::string& what = "--stream");
const char* stream_method_name(StreamMethod m);

// A retrieval head (Wu et al.): query head `head` of layer `layer`, with its retrieval score.
struct RetrievalHead {
  int32_t layer = 0;
  int32_t head = 0;
  double score = 0;
};
// A retrieval heads file (`--stream-retrieval-heads`, `tessera eval --retrieval-heads-out`): "layer head
// score" lines,
// '#' comments and empty lines skipped; tessera::Error naming the file (and the line) when it cannot be read
// or a line is not three numbers.
std::vector<RetrievalHead> read_retrieval_heads(const std::string& path);

struct StreamOptions {
  StreamMethod method = StreamMethod::None;  // None: no streaming (the engine's dense or per-head cache)
  int32_t sinks = 128;       // initial tokens, always attended
  int32_t local = 4096;      // local window (tokens before the chunk, at their true positions)
  int32_t chunk = 512;       // prefill chunk (tokens per forward pass)
  // The last chunk of a prefill holds at most this many tokens (0: chunk), so that the query the retrieval is made
  // for (the question at the prompt's end) is not drowned in context: the paper sizes it to the query (32 for its
  // needle prompts). Its retrieval persists through decode.
  int32_t last_chunk = 64;
  int32_t block = 128;       // tokens per evicted block (the unit of host memory and of retrieval)
  int32_t top_k = 32;        // blocks retrieved per chunk (streamingllm: 0)
  // Host memory for evicted blocks, bytes (0: the process's host memory budget, core/memory_budget.h).
  int64_t host_budget = 0;
  // The GPU path's evicted blocks in FP8 (`--stream-host-kv fp8`): E4M3 codes with an f32 scale per token and kv
  // head (amax / 448), quantized on the device before the copy to pinned host memory and dequantized into the
  // attention's workspace after the copy back — 0.52x the bytes of bf16 blocks (host memory and PCIe traffic) for the
  // retrieved keys' and values' rounding. The CPU path keeps f32 blocks whatever this says.
  bool host_fp8 = false;

  // Ltri-LLM: span discovery (span_discovery.h) and dynamic index vectors (span_index.h).
  double theta_quantile = 0.9;  // threshold theta = this quantile of the summed attention map's causal entries
  double iou = 0.1;             // NMS IoU threshold tau
  bool linear_nms = true;       // keep only the best point per anti-diagonal before NMS (Appendix E)
  double lambda = 3;            // retention slope
  double lambda_early = 20;     // ... in the first `early_layers` layers
  int32_t early_layers = 4;
  int32_t min_vectors = 1;      // index vectors per span, clamped to [min_vectors, max_vectors]
  int32_t max_vectors = 12;
  // > 0: a target compression ratio (evicted tokens per index vector, >= 1) instead of the fixed lambdas above: each
  // layer's lambda is the smallest that meets it on the spans that layer has indexed so far (the paper's lookup
  // table, Sec. 3.3.2; span_index.h LambdaTable), chosen again at every evicted block. 0: lambda / lambda_early.
  double index_ratio = 0;
  // Retrieval heads: only the best one per layer with score > 0.1 votes for its layer, and layers combine the
  // votes of earlier layers' heads (collaborative voting), weighted by score. Empty: every head of a layer votes
  // (averaged) and there is no collaborative voting.
  std::vector<RetrievalHead> retrieval_heads;
  // Ltri with retrieval heads: which kv heads each layer's span index keeps (the paper counts the retrieval heads'
  // vectors only). false (the default, `--stream-index-heads retrieval`): a layer with a retrieval head keeps its kv
  // head only (the only one its scores read), a later layer without one keeps none (collaborative voting replaces its
  // scores: it is never scored), the layers before the first retrieval layer keep every kv head (they score with all
  // heads). The block scores, retrieved blocks and outputs are exactly the full index's. true (`all`): every layer
  // keeps every kv head (the comparison). No effect without retrieval heads.
  bool index_all_heads = false;
  // Ltri with retrieval heads: the layers before the first retrieval layer (no head of theirs votes and no earlier
  // layer's votes exist within the chunk). false (`--stream-early-layers score`, the default): each scores its blocks
  // with every head (uniform weights) over an index of every kv head. true (`votes`): each takes the top-K of the
  // previous chunk's collaborative vote (every retrieval head's normalised scores weighted by its score; blocks
  // evicted since then score 0; the most recent top-K blocks while no chunk has voted yet) and, like a voted-only
  // layer, keeps no index and needs no map, query vectors or scoring — at 1M tokens on Llama-3-8B shapes those layers'
  // scoring alone was 22 of 95 s.
  bool early_from_votes = false;
  // Ltri with retrieval heads: the attention map a layer with a retrieval head discovers its spans and picks its index
  // and query vectors from. false (`--stream-map-heads all`, the default; the paper's): the sum of every query head's
  // softmax map. true (`retrieval`): its retrieval head's map alone (the head its block scores read) — 1 / q_heads of
  // the map's products and memory. Layers without a retrieval head map with every head either way.
  bool map_retrieval_head = false;
  bool persist_decode = true;   // decode keeps the blocks retrieved for the last prefill chunk

  // InfLLM: representative keys per block.
  int32_t repr_keys = 4;

  // Tokens a chunk attends to at most: sinks + top_k blocks + local window + one block of slack + the chunk.
  int64_t attended_tokens() const;
};

// StreamingLLM at the same memory as `o`: no retrieval, the retrieved blocks' room given to the local window.
StreamOptions streamingllm_equal_memory(StreamOptions o);

// Throws tessera::Error naming the option (as its --stream-* flag) when a size is out of range.
void check_stream_options(const StreamOptions& o);
// The end of the prefill chunk that starts at c0 of a prompt of n tokens: chunks of o.chunk tokens, the last one of
// at most o.last_chunk (the query's own chunk, from which retrieval is made).
int64_t stream_chunk_end(const StreamOptions& o, int64_t c0, int64_t n);

}  // namespace tessera::runtime

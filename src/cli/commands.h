// tessera/cli/commands.h — the subcommands of the `tessera` program.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attention/index/prefill_route.h"
#include "runtime/sampling.h"
#include "runtime/stream/stream_options.h"

namespace tessera::cli {

// --prefill-kernel / --dense-backend: the CUDA attention backend's options (attention/index/prefill_route.h) for
// --device cuda; empty: the process defaults (CudaAttentionOptions with the documented environment overrides).
struct CudaAttentionFlags {
  std::string prefill_kernel;  // auto | mma | wgmma
  std::string dense_backend;   // auto | ours | cudnn
  std::string gemm;            // bf16 | fp8 (--gemm): the GPU engine's GEMM precision (runtime/cuda/gemm.h); empty: bf16
};
// The options the flags ask for. Throws tessera::Error when a flag is given for a run on the CPU.
attn::gpu::CudaAttentionOptions cuda_attention_options(const CudaAttentionFlags& flags, bool gpu);
// --gemm fp8 asked for; throws "--gemm fp8 is not supported with --gpus (...)" when tensor_parallel.
bool gemm_fp8(const CudaAttentionFlags& flags, bool tensor_parallel = false);
// --gemm w4: the decode step's products over 4-bit weights (runtime::EngineOptions::Gpu::w4_decode).
bool gemm_w4(const CudaAttentionFlags& flags, bool tensor_parallel = false);
// --kv-type fp8: the GPU's KV blocks in FP8 E4M3 (runtime::EngineOptions::Gpu::fp8_kv; set_kv_fp8 is --kv-type's).
// Throws "--kv-type fp8 is not supported with --gpus (tensor parallelism): run on one GPU" when tensor_parallel and
// "--kv-type fp8 is the GPU's KV type (--device cuda); the CPU's KV cache is f32, bf16 or f16" when !gpu.
bool kv_fp8(bool gpu, bool tensor_parallel = false);
void set_kv_fp8(bool on);
// The checks of --gpus (tensor parallelism) on the precision flags: --gemm fp8 / w4 and --kv-type fp8 run on one GPU.
void check_tensor_parallel_precisions(const CudaAttentionFlags& flags);

// --stream and its sizes: streaming memory over unbounded context (runtime/stream/stream_options.h), CPU or GPU.
struct StreamFlags {
  std::vector<std::string> methods;  // ltri | infllm | streamingllm (run: at most one); empty: no streaming
  int sinks = 128, local = 4096, chunk = 512, block = 128, top_k = 32, last_chunk = 64;
  std::string host_budget;      // host memory for evicted blocks ("4G"); empty: the host memory budget
  std::string host_kv = "bf16";  // the GPU path's evicted blocks: bf16 or fp8 (StreamOptions::host_fp8)
  std::string retrieval_heads;  // a file of "layer head score" lines (Ltri's retrieval-head voting); empty: none
  double index_ratio = 0;       // ltri: evicted tokens per index vector (per-layer lambda search); 0: fixed lambda
  std::string index_heads = "retrieval";  // ltri with retrieval heads: "retrieval" (their kv heads only) or "all"
  std::string map_heads = "all";          // ltri with retrieval heads: a voting layer's map of "all" heads or its "retrieval" head
  std::string early_layers = "score";     // ltri with retrieval heads, the layers before the first one: "score" or "votes"
};
// The engine options of one --stream method (the same on the CPU and the GPU but --stream-host-kv fp8, the GPU's
// only: `gpu` says which). streamingllm gets the retrieved blocks' room as local window (equal memory). Throws
// tessera::Error naming the flag for bad sizes.
runtime::StreamOptions stream_options(const StreamFlags& flags, const std::string& method, bool gpu);
// "stream:ltri" for a --stream method: the name its rows carry in bench and eval tables.
std::string stream_label(const std::string& method);
// The method of a "stream:..." label, or "" for an attention policy spec.
std::string stream_method_of(const std::string& label);
// cpu for --device auto when streaming; the error above for --device cuda.
bool use_gpu_device_for(const std::string& device, const StreamFlags& stream);

struct RunOptions {
  std::string model;
  std::string prompt;       // text, or
  std::string prompt_file;  // a file holding it; "-": standard input
  bool chat = false;
  std::string system;
  std::string attn = "dense";
  bool compare = false;  // run dense first, then `attn`, and print both answers and the speedup
  int max_tokens = 128;   // -1: until the end of the text or the context is full
  runtime::SamplingOptions sampling;
  int chunk = 2048;
  int max_context = 0;
  bool progress = false;  // force the progress bar when stderr is not a terminal
  bool quiet = false;     // stdout holds only the generated text (and a newline)
  bool json = false;      // stdout holds one JSON object: text, tokens, finish reason, timings (docs/cli.md)
  // Needle-in-a-haystack prompt instead of --prompt: a tokens-long haystack with one needle at `needle_depth`
  // (0..1), built by eval's niah_single generator; the answer is then checked against the needle.
  int needle_tokens = 0;
  double needle_depth = 0.5;
  uint64_t needle_seed = 0;
  std::string haystack = "kjv";
  std::string device = "auto";  // cpu | cuda | auto (cuda when a GPU is usable and tessera was built with CUDA)
  CudaAttentionFlags cuda;
  StreamFlags stream;
  int gpus = 1;           // > 1: the tensor-parallel engine (cli/run_tp.cpp, docs/multi-gpu.md)
  std::string placement;  // its head placement file (default: genetic on the FLOP cost model)
  std::string logits_out; // the logits after the prompt, raw f32 (session.h write_logits)
  std::string stream_trace;  // --stream: the blocks each layer retrieved, per prefill chunk and decode step
  // Structured output, llama.cpp's flags (runtime/grammar.h): the answer follows a grammar (XGrammar's EBNF, the
  // notation of llama.cpp's GBNF, root rule "root") or is JSON valid under a JSON Schema; text or a file. One of them.
  std::string grammar, grammar_file, json_schema, json_schema_file;
};

struct BenchOptions {
  std::string model;
  std::vector<int> depths = {1024, 4096, 8192};
  std::vector<std::string> attn = {"trianglemix", "ashape:sink=64,local=1024"};
  int decode_tokens = 16;
  int chunk = 2048;
  int reps = 1;
  std::string format = "md";  // md | csv | json
  std::string device = "auto";  // cpu | cuda | auto
  CudaAttentionFlags cuda;
  StreamFlags stream;  // each method adds a row per depth (depths past the model's context: stream rows only)
  int gpus = 1;        // > 1: the tensor-parallel engine (cli/bench_tp.cpp, docs/multi-gpu.md)
};

struct EvalOptions {
  std::string model;
  std::vector<std::string> tasks = {"niah_single"};  // empty: no task suite (only layer stats / perplexity)
  std::vector<int> lengths = {1024, 2048, 4096};
  std::vector<double> depths = {0, 25, 50, 75, 100};
  int samples = 1;
  uint64_t seed = 0;
  std::vector<std::string> attn = {"trianglemix"};  // dense always runs first
  std::string haystack = "kjv";
  std::string chat = "auto";  // auto | on | off
  int answer_tokens = 0;      // 0: the task's RULER budget
  bool full_answers = false;  // generate the whole budget even after every answer appeared
  int chunk = 2048;
  std::string out = "eval-out";
  bool resume = false;
  bool report_only = false;
  std::vector<int> layer_stats_lengths;  // per-layer attention metrics at these lengths
  std::vector<int> perplexity_lengths;   // perplexity at these lengths
  std::string gemm;                      // --gemm bf16 | fp8: the GPU engine's GEMMs (task cases, perplexity)
  std::string device = "auto";           // cpu | cuda | auto: where the task cases and the perplexity run
                                         // (layer stats always run on the CPU engine)
  std::string command_line;              // recorded in the reports
  std::string model_name;                // filled in by eval_command
  StreamFlags stream;                    // each method runs every case as policy "stream:<method>"; lengths past
                                         // the model's context run only those
  std::string retrieval_heads_out;       // write the retrieval heads found on niah_single cases (dense) here
};

struct ServeOptions {
  std::string model;
  std::string model_name;        // the name clients pass as "model"; empty: the file's stem
  std::string host = "127.0.0.1";
  int port = 8080;               // 0: any free port (printed)
  std::string attn = "dense";    // the default policy; requests pick others with "tessera": {"attn": ...}
  std::string policy_dir;        // policy files requests may name (as plans)
  std::string device = "auto";   // cpu | cuda | auto
  int parallel = 1;              // sequences generated at once; > 1: the batched engine (continuous batching)
  std::string kv_budget;         // the batched engine's KV memory ("8G"); empty: its default
  bool prefix_cache = true;      // the batched engine reuses cached prompt blocks (--no-prefix-cache: off)
  int step_tokens = 0;           // the batched engine's token budget per step (0: none; --step-tokens)
  int queue = 16;                // requests that may wait for a slot
  int chunk = 2048;              // prefill chunk size
  int max_context = 0;           // 0: the model's
  std::string api_key;           // empty: none (also from TESSERA_API_KEY)
  double timeout = 600;          // seconds per request
  int max_body_mb = 8;           // request body limit
  bool quiet = false;            // no per-request lines
  CudaAttentionFlags cuda;
  int gpus = 1;                  // > 1: the tensor-parallel engine, one process per GPU (docs/multi-gpu.md)
  std::string placement;         // its head placement file (default: the --attn plan's, else genetic)
  StreamFlags stream;            // --stream: every request through streaming memory (docs/streaming.md)
};

struct PlanOptions {
  std::string method;                    // minference | moa | trianglemix
  std::string model;
  std::optional<double> budget;          // mean density in (0, 1]; default per method (minference 0.3, moa 0.5,
                                         // trianglemix: the probe's threshold rule)
  std::string calib;                     // a .jsonl of prompt/target pairs or a text file; empty: synthetic
  std::vector<int> lengths = {1024, 2048};  // calibration lengths (MoA: the profiled lengths)
  int samples = 2;                       // synthetic samples per length
  bool calib_tasks = false;              // with calib: the synthetic tasks too
  uint64_t seed = 0;
  int answer_tokens = 16;                // tokens of each dense answer (the targets)
  std::string haystack = "kjv";
  std::vector<int> validation_lengths = {3072};  // MoA: perplexity at these unseen lengths picks among the Pareto
                                                 // plans ({0}: none)
  int validation_texts = 1;              // MoA: held-out texts per validation length (the perplexity's)
  int validation_cases = 4;              // held-out tasks per validation length (agreement with dense's answers)
  std::string compare_with = "auto";    // presets beside the plan on the held-out tasks (';'-separated; none)
  int minference_query_rows = 128;       // MInference: the per-head choice also weighs the last rows' error (0: all rows)
  double minference_query_weight = 0.75; // MInference: the last rows' error's weight in the choice
  bool minference_repair = false;        // MInference: take candidates out while the plan loses held-out answers
  std::string moa_loss = "fisher";       // MoA: a rule's loss from its masked influence (fisher | first-order)
  bool moa_layer_repair = false;         // MoA: the uniform window on the layers where the plan's rules lose to it
  bool moa_no_sink_only = false;         // MoA: leave out the rules that keep the sink alone at a profiled length
  double moa_head_cap = 1;               // MoA: the share of a head's influence mass a rule may mask (1: no cap)
  int moa_beta_steps = 8;                // MoA: the beta grid's steps (MoA's 8: betas 0, 1/8, ..., 1)
  std::string moa_profile_out;           // MoA: save the gradient profile here (load_moa_profile reads it)
  std::string moa_profile_in;            // MoA: the saved profile instead of the reverse-mode passes
  std::string attn;                      // --method measure: the policies (';'-separated specs or plan files)
  double threshold = 0.1;                // TriangleMix: Middle gradient relative to its largest
  std::string inner = "dense";           // TriangleMix: the shallow layers' policy (dense, vs or a policy file)
  std::optional<double> trianglemix_select;  // TriangleMix: choose the split by held-out validation (this log-
                                              // perplexity tolerance over dense; plan::select_split)
  std::vector<int> report_lengths = {4096, 16384, 65536};
  std::string out;                       // the plan (tessera policy JSON)
  std::string svg;                       // the picture; empty: beside out
  std::string device = "cpu";            // moa / trianglemix: where the reverse-mode passes run (cpu, cuda, auto)
  int gpus = 0;                          // > 0: also place the heads over this many GPUs (saved as "placement")
  std::string placement = "genetic";     // ... by this method (uniform, greedy, genetic)
  int placement_length = 0;              // ... for prompts of this length (0: the longest --report-lengths)
  std::string command_line;
};

// `tessera tokenize`: the token ids of a text (-p, or -f FILE|-), as `tessera run` would prefill them.
struct TokenizeOptions {
  std::string model;
  std::string prompt;
  std::string prompt_file;     // "-": standard input
  bool chat = false;           // as run --chat: a user turn in the model's chat format
  std::string system;          // with chat
  bool no_special = false;     // plain text: no BOS (or other special tokens the tokenizer adds)
  bool parse_special = false;  // plain text: "<|im_start|>" and the like in the text are their special tokens
  bool ids = false;            // one line: [id, id, ...]
  bool json = false;           // one JSON object: ids, pieces, count
};

struct InspectOptions {
  std::string model;
  bool tensors = false;
  bool metadata = false;
};

// --device: true for the GPU engine (runtime/cuda). "auto" picks it when tessera was built with CUDA and a device
// is usable; "cuda" without either throws tessera::Error saying which is missing.
bool use_gpu_device(const std::string& device);

// Checks of the options that need no model (flags' ranges, --attn specs), run before anything is loaded. Throw
// tessera::Error naming the flag: "--top-p must be in (0, 1] (1 = off), got 1.5".
void check_run_options(const RunOptions& o);
void check_bench_options(const BenchOptions& o);
void check_eval_options(const EvalOptions& o);
void check_plan_options(const PlanOptions& o);
void check_tokenize_options(const TokenizeOptions& o);

// The prompt text of -p / -f FILE / -f - (standard input), read whole; tessera::Error for a file that cannot be a
// prompt (missing, a directory, over 1 GiB) or standard input past 1 GiB.
std::string read_prompt(const std::string& prompt, const std::string& prompt_file);

int run_command(const RunOptions& o);
// `tessera run --gpus N` (or --placement): the tensor-parallel engine over N GPUs (cli/run_tp.cpp).
int run_tp_command(const RunOptions& o);
// `tessera bench --gpus N`: the tensor-parallel engine's rates (cli/bench_tp.cpp).
int bench_tp_command(const BenchOptions& o);
int bench_command(const BenchOptions& o);
int inspect_command(const InspectOptions& o);
int tokenize_command(const TokenizeOptions& o);
int eval_command(EvalOptions o);
int serve_command(const ServeOptions& o);
int plan_command(const PlanOptions& o);

}  // namespace tessera::cli

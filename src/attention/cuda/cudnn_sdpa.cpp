// cuDNN fused SDPA through the v9 graph (backend) API (contract: cudnn_sdpa.h).
#include "attention/cuda/cudnn_sdpa.h"

#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "attention/cuda/sparse_prefill.h"
#include "core/dtype.h"
#include "core/error.h"

#if TESSERA_HAS_CUDNN
#include <cudnn_graph.h>
#include <cudnn_version.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#endif

namespace tessera::attn::gpu {

bool cudnn_dense_supports(const AttentionArgs& a, std::string* why) {
  auto no = [&](const std::string& reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (!cudnn_built()) return no("built without cuDNN");
  try {
    validate_cuda_args(a);
  } catch (const Error& e) {
    return no(e.what());
  }
  if (a.window > 0) return no("sliding window (args.window > 0): not in the cuDNN graph");
  if (a.q_begin != 0 || a.kv_len() != a.q_len())
    return no("cuDNN dense runs whole-prompt prefill only (q_begin 0, kv_len = q_len)");
  if (a.q_len() == 0) return no("empty call");
  const int64_t d = a.head_dim();
  if (d % 8 != 0 || d > 256) return no("head_dim must be a multiple of 8 up to 256");
  if (a.has_lse() && (a.lse.stride[1] != 1 || a.lse.stride[0] != a.q_len()))
    return no("lse must be contiguous [num_q_heads, q_len] for cuDNN");
  return true;
}

#if !TESSERA_HAS_CUDNN

bool cudnn_built() {
  return false;
}
bool cudnn_available(std::string* why) {
  if (why != nullptr)
    *why = "built without cuDNN (no cuDNN 9 headers/library were found when tessera was configured)";
  return false;
}
int cudnn_version() {
  return 0;
}
bool cudnn_dense_plan(const AttentionArgs&, std::string* why) {
  return cudnn_available(why);
}
void cudnn_dense_attention(const AttentionArgs&, cudaStream_t) {
  throw Error("CUDA attention: cuDNN dense attention requested, but tessera was built without cuDNN");
}

#else  // TESSERA_HAS_CUDNN

namespace {

std::string status_text(cudnnStatus_t s) {
  std::string t = cudnnGetErrorString(s);
  char last[1024] = {0};
  cudnnGetLastErrorString(last, sizeof last);
  if (last[0] != 0) t += std::string(" (") + last + ")";
  return t;
}

void ck(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS) throw Error(std::string("cuDNN ") + what + ": " + status_text(s));
}

// An owned backend descriptor.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    ck(cudnnBackendCreateDescriptor(type, &d_), "create descriptor");
  }
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
         int64_t count, const void* values, const char* what) {
  ck(cudnnBackendSetAttribute(d, name, type, count, values), what);
}

using Dims = std::array<int64_t, 4>;

// The operation graph of causal SDPA with stats (see cudnn_sdpa.h), its descriptors kept alive.
struct GraphBuilder {
  std::vector<std::unique_ptr<Desc>> keep;
  std::vector<cudnnBackendDescriptor_t> ops;
  int64_t next_virtual_uid = 100;

  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t type) {
    keep.push_back(std::make_unique<Desc>(type));
    return keep.back()->get();
  }

  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                  bool is_virtual, bool by_value = false) {
    cudnnBackendDescriptor_t t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor data type");
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dimensions");
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    if (is_virtual) {
      const bool v = true;
      set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v, "tensor is_virtual");
    }
    if (by_value) {
      const bool v = true;
      set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &v, "tensor is_by_value");
    }
    ck(cudnnBackendFinalize(t), "finalize tensor");
    return t;
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual_uid++, type, dims, strides, true);
  }

  // An operation of `type` with its descriptor attributes set in the order given (those whose descriptor is null
  // left out), finalised (`finalize` names the step in errors) and appended to the graph's operations.
  struct OperandAttr {
    cudnnBackendAttributeName_t name;
    cudnnBackendDescriptor_t desc;
    const char* what;
  };
  void add_operation(cudnnBackendDescriptorType_t type, std::initializer_list<OperandAttr> attrs,
                     const char* finalize) {
    cudnnBackendDescriptor_t op = make(type);
    for (const OperandAttr& a : attrs)
      if (a.desc != nullptr) set(op, a.name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a.desc, a.what);
    ck(cudnnBackendFinalize(op), finalize);
    ops.push_back(op);
  }

  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul compute type");
    ck(cudnnBackendFinalize(mm), "finalize matmul");
    add_operation(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
                  {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, "matmul A"},
                   {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, "matmul B"},
                   {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, "matmul C"},
                   {CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, "matmul desc"}},
                  "finalize matmul operation");
  }

  // y = mode(x [, b] [, t]); axis >= 0 for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
    if (axis >= 0) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    ck(cudnnBackendFinalize(pw), "finalize pointwise");
    add_operation(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
                  {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, "pointwise desc"},
                   {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x"},
                   {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, "pointwise b"},
                   {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, "pointwise t"},
                   {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y"}},
                  "finalize pointwise operation");
  }

  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t rd = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction mode");
    set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction compute type");
    ck(cudnnBackendFinalize(rd), "finalize reduction");
    add_operation(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
                  {{CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x"},
                   {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y"},
                   {CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, "reduction desc"}},
                  "finalize reduction operation");
  }

  // The operations above into a new virtual tensor y of `type` and `shape` (made, and its uid taken, just before
  // the operation): y.
  struct Shape {
    const Dims& dims;
    const Dims& strides;
  };
  cudnnBackendDescriptor_t matmul(Shape shape, cudnnDataType_t type, cudnnBackendDescriptor_t a,
                                  cudnnBackendDescriptor_t b) {
    cudnnBackendDescriptor_t y = virt(type, shape.dims, shape.strides);
    matmul(a, b, y);
    return y;
  }
  cudnnBackendDescriptor_t pointwise(Shape shape, cudnnDataType_t type, cudnnPointwiseMode_t mode,
                                     cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t b = nullptr, cudnnBackendDescriptor_t t = nullptr,
                                     int64_t axis = -1) {
    cudnnBackendDescriptor_t y = virt(type, shape.dims, shape.strides);
    pointwise(mode, prec, x, b, t, y, axis);
    return y;
  }
  cudnnBackendDescriptor_t reduction(Shape shape, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x) {
    cudnnBackendDescriptor_t y = virt(CUDNN_DATA_FLOAT, shape.dims, shape.strides);
    reduction(mode, x, y);
    return y;
  }
};

// Unique ids of the real (variant pack) tensors.
enum : int64_t { kUidQ = 1, kUidK, kUidV, kUidO, kUidStats, kUidScale, kUidNegInf };

// Shape and strides of a call, and whether it wants the lse: what a plan depends on (pointers and the scale
// value do not).
using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, bool>;

PlanKey key_of(const AttentionArgs& a, int device) {
  return {device,        static_cast<int>(a.q.dtype), a.num_q_heads(), a.num_kv_heads(), a.q_len(),
          a.head_dim(),  a.q.stride[0],               a.q.stride[1],   a.k.stride[0],     a.k.stride[1],
          a.v.stride[0], a.v.stride[1],               a.out.stride[0], a.out.stride[1],   a.has_lse()};
}

// The graph's free choices. The first variant is the graph cudnn-frontend's SDPA node lowers to (causal
// mask = GEN_INDEX row/col, CMP_GE, BINARY_SELECT; the softmax output P, matmul 2's A operand, in the I/O
// type: the fused engines take bmm2's A in bf16/f16, never f32 — run 3's graph had P in f32 and got no engine
// at all). The others are tried only when it gets none, so that one GPU run says which choice matters.
struct GraphVariant {
  const char* name;
  bool p_in_io_type;            // P (softmax output, bmm2's A) in bf16/f16 (true) or f32
  cudnnDataType_t index_prec;   // GEN_INDEX math precision (frontend: the graph's compute type, f32)
  bool stats;                   // stats (lse) as a graph output; without: only for calls with no lse
};

constexpr std::array<GraphVariant, 4> kVariants{{
    {"P io-type, index prec f32, stats", true, CUDNN_DATA_FLOAT, true},
    {"P io-type, index prec int32, stats", true, CUDNN_DATA_INT32, true},
    {"P io-type, index prec f32, no stats", true, CUDNN_DATA_FLOAT, false},
    {"P f32 (run-3 graph), stats", false, CUDNN_DATA_INT32, true},
}};

// One finalised execution plan (an engine config of one graph variant).
struct Candidate {
  std::unique_ptr<Desc> plan;
  int64_t workspace_bytes = 0;
  bool stats = true;   // whether its graph writes stats (variant pack has the stats pointer)
  std::string label;   // "heuristics A config 2 (engine 8 {k1=2})", for the record
  std::string signature;  // config_signature of its engine config ("" when unknown)
};

// Autotuning (TESSERA_CUDNN_AUTOTUNE=1 switches it on; off by default since the H200 run of 2026-11-22 found
// heuristics A config 0 fastest at 8K, 32K and 128K, and tuning adds ~0.9 s to the first 128K call): at plan build, besides the plan of the
// first engine config that finalises (candidate 0: what runs without autotuning), up to kMaxCandidates - 1
// more distinct engine configs (rest of heuristics A, heuristics B, fallback; and the no-stats graph when the
// caller has no lse) are finalised, within kExtraFinalizeMs of host time. The first execution of the shape
// times them on the call's own buffers (TESSERA_CUDNN_AUTOTUNE_BUDGET_MS, default 1500, of GPU time in all)
// and keeps the fastest. Any failure keeps candidate 0.
constexpr size_t kMaxCandidates = 6;
constexpr double kExtraFinalizeMs = 1000.0;

bool autotune_enabled() {
  const char* e = std::getenv("TESSERA_CUDNN_AUTOTUNE");
  return e != nullptr && std::string(e) == "1";  // off by default: on the H200 config 0 won every shape
}

double autotune_budget_ms() {
  const char* e = std::getenv("TESSERA_CUDNN_AUTOTUNE_BUDGET_MS");
  if (e != nullptr) {
    char* end = nullptr;
    const double v = std::strtod(e, &end);
    if (end != e && v > 0) return v;
  }
  return 1500.0;
}

struct Plan {
  GraphBuilder graph;
  std::unique_ptr<Desc> op_graph;
  std::vector<std::unique_ptr<Desc>> heuristics;  // kept alive with the configs they produced
  std::vector<std::unique_ptr<Desc>> configs;
  std::unique_ptr<Desc> engine;  // when the plan came from the engine list (no heuristics result)
  bool stats = true;             // whether this graph writes stats
  std::vector<Candidate> candidates;             // [0]: the plan without autotuning
  std::vector<std::unique_ptr<Plan>> others;     // other graph variants whose candidates are in `candidates`
  size_t chosen = 0;
  bool tune_pending = false;     // more than one candidate, not timed yet
  std::string how;               // variant and engine config of candidate 0, for the record
  std::string tune_note;         // what autotuning did
  DeviceBuffer<unsigned char> workspace;
  DeviceBuffer<float> stats_scratch;  // when the caller has no lse
};

// The operation graph of `v` for call `a`, finalised into p->op_graph (throws on a descriptor failure).
void build_graph(cudnnHandle_t handle, const AttentionArgs& a, const GraphVariant& v, Plan& p) {
  GraphBuilder& g = p.graph;
  const cudnnDataType_t io = a.q.dtype == DType::BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  const int64_t hq = a.num_q_heads(), hkv = a.num_kv_heads(), s = a.q_len(), d = a.head_dim();
  // Token-major [S, H, d] views as [1, H, S, d] (K transposed as [1, H, d, S]: dims 2 and 3 and their strides
  // swapped, as cudnn-frontend maps K to K^T).
  const Dims q_dims{1, hq, s, d}, q_str{s * a.q.stride[0], a.q.stride[1], a.q.stride[0], 1};
  const Dims kt_dims{1, hkv, d, s}, kt_str{s * a.k.stride[0], a.k.stride[1], 1, a.k.stride[0]};
  const Dims v_dims{1, hkv, s, d}, v_str{s * a.v.stride[0], a.v.stride[1], a.v.stride[0], 1};
  const Dims o_dims{1, hq, s, d}, o_str{s * a.out.stride[0], a.out.stride[1], a.out.stride[0], 1};
  const Dims s_dims{1, hq, s, s}, s_str{hq * s * s, s * s, s, 1};
  const Dims r_dims{1, hq, s, 1}, r_str{hq * s, s, 1, 1};
  const Dims one{1, 1, 1, 1};

  cudnnBackendDescriptor_t tq = g.tensor(kUidQ, io, q_dims, q_str, false);
  cudnnBackendDescriptor_t tk = g.tensor(kUidK, io, kt_dims, kt_str, false);
  cudnnBackendDescriptor_t tv = g.tensor(kUidV, io, v_dims, v_str, false);
  cudnnBackendDescriptor_t to = g.tensor(kUidO, io, o_dims, o_str, false);
  cudnnBackendDescriptor_t tscale = g.tensor(kUidScale, CUDNN_DATA_FLOAT, one, one, false, true);
  cudnnBackendDescriptor_t tneg = g.tensor(kUidNegInf, CUDNN_DATA_FLOAT, one, one, false, true);

  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  const GraphBuilder::Shape sc{s_dims, s_str}, rows{r_dims, r_str};  // scores, per row
  // S = Q K^T (f32), scaled.
  cudnnBackendDescriptor_t s0 = g.matmul(sc, f32, tq, tk);
  cudnnBackendDescriptor_t s1 = g.pointwise(sc, f32, CUDNN_POINTWISE_MUL, f32, s0, tscale);
  // Causal mask (top-left diagonal): keep row >= col, else the lowest float.
  cudnnBackendDescriptor_t row =
      g.pointwise(sc, CUDNN_DATA_INT32, CUDNN_POINTWISE_GEN_INDEX, v.index_prec, s1, nullptr, nullptr, 2);
  cudnnBackendDescriptor_t col =
      g.pointwise(sc, CUDNN_DATA_INT32, CUDNN_POINTWISE_GEN_INDEX, v.index_prec, s1, nullptr, nullptr, 3);
  cudnnBackendDescriptor_t keep =
      g.pointwise(sc, CUDNN_DATA_BOOLEAN, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col);
  cudnnBackendDescriptor_t s2 = g.pointwise(sc, f32, CUDNN_POINTWISE_BINARY_SELECT, f32, s1, tneg, keep);
  // Softmax (f32) with stats = max + log(sum).
  cudnnBackendDescriptor_t mx = g.reduction(rows, CUDNN_REDUCE_TENSOR_MAX, s2);
  cudnnBackendDescriptor_t sub = g.pointwise(sc, f32, CUDNN_POINTWISE_SUB, f32, s2, mx);
  cudnnBackendDescriptor_t ex = g.pointwise(sc, f32, CUDNN_POINTWISE_EXP, f32, sub);
  cudnnBackendDescriptor_t sum = g.reduction(rows, CUDNN_REDUCE_TENSOR_ADD, ex);
  if (v.stats) {
    cudnnBackendDescriptor_t tstats = g.tensor(kUidStats, f32, r_dims, r_str, false);
    cudnnBackendDescriptor_t lg = g.pointwise(rows, f32, CUDNN_POINTWISE_LOG, f32, sum);
    g.pointwise(CUDNN_POINTWISE_ADD, f32, mx, lg, nullptr, tstats);
  }
  // P = exp / sum, in the I/O type (bmm2's A operand), math in f32.
  cudnnBackendDescriptor_t prob = g.pointwise(sc, v.p_in_io_type ? io : f32, CUDNN_POINTWISE_DIV, f32, ex, sum);
  // O = P V.
  g.matmul(prob, tv, to);

  p.op_graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  cudnnBackendDescriptor_t og = p.op_graph->get();
  set(og, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(g.ops.size()),
      g.ops.data(), "graph operations");
  set(og, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "graph handle");
  ck(cudnnBackendFinalize(og), "finalize operation graph");
}

// The text of cuDNN's last error on this thread (empty when none), cleared by reading it.
std::string last_error() {
  char last[1024] = {0};
  cudnnGetLastErrorString(last, sizeof last);
  return last;
}

// Finalises an execution plan for `cfg` into `out`; false (status appended to `log`) when it does not.
bool try_config(cudnnHandle_t handle, cudnnBackendDescriptor_t cfg, bool stats, const std::string& label,
                std::string& log, Candidate& out) {
  auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  set(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "plan handle");
  set(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg,
      "plan engine config");
  const cudnnStatus_t ps = cudnnBackendFinalize(plan->get());
  if (ps != CUDNN_STATUS_SUCCESS) {
    log += " [" + label + " plan finalize: " + status_text(ps) + "]";
    return false;
  }
  int64_t ws = 0, n = 0;
  ck(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws),
     "plan workspace size");
  out.plan = std::move(plan);
  out.workspace_bytes = ws;
  out.stats = stats;
  out.label = label;
  return true;
}

// Candidate 0 of p from `cfg` (the previous behaviour: the first config that finalises).
bool try_primary(cudnnHandle_t handle, cudnnBackendDescriptor_t cfg, Plan& p, const std::string& label,
                 std::string& log) {
  Candidate c;
  if (!try_config(handle, cfg, p.stats, label, log, c)) return false;
  p.how += ", " + label + ", workspace " + std::to_string(c.workspace_bytes) + " B";
  p.candidates.clear();
  p.candidates.push_back(std::move(c));
  return true;
}

// "engine 8 {k3=1,k10=2}": engine global index and knob choices of an engine config (dedupes the heuristics
// modes' answers); "" when cuDNN does not say.
std::string config_signature(cudnnBackendDescriptor_t cfg) {
  try {
    Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    cudnnBackendDescriptor_t e = engine.get();
    int64_t n = 0;
    if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) !=
            CUDNN_STATUS_SUCCESS ||
        n != 1)
      return "";
    int64_t idx = -1;
    if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &idx) !=
        CUDNN_STATUS_SUCCESS)
      return "";
    std::string sig = "engine " + std::to_string(idx) + " {";
    int64_t count = 0;
    if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr) != CUDNN_STATUS_SUCCESS)
      return "";
    if (count > 0) {
      std::vector<std::unique_ptr<Desc>> keep;
      std::vector<cudnnBackendDescriptor_t> raw;
      for (int64_t i = 0; i < count; ++i) {
        keep.push_back(std::make_unique<Desc>(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR));
        raw.push_back(keep.back()->get());
      }
      int64_t got = 0;
      if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                   &got, raw.data()) != CUDNN_STATUS_SUCCESS)
        return "";
      for (int64_t i = 0; i < got; ++i) {
        cudnnBackendKnobType_t type{};
        int64_t value = 0;
        if (cudnnBackendGetAttribute(raw[static_cast<size_t>(i)], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                                     CUDNN_TYPE_KNOB_TYPE, 1, &n, &type) != CUDNN_STATUS_SUCCESS ||
            cudnnBackendGetAttribute(raw[static_cast<size_t>(i)], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE,
                                     CUDNN_TYPE_INT64, 1, &n, &value) != CUDNN_STATUS_SUCCESS)
          return "";
        sig += (i == 0 ? "k" : ",k") + std::to_string(static_cast<int>(type)) + "=" + std::to_string(value);
      }
    }
    return sig + "}";
  } catch (const Error&) {
    return "";
  }
}

// The engine configs heuristics `mode` returns for p's graph (kept alive in p); appends what it gave to `log`
// when `log` is not null. Throws on a descriptor failure other than the heuristics' own finalize.
std::vector<cudnnBackendDescriptor_t> heuristic_configs(Plan& p, cudnnBackendHeurMode_t mode, const char* mode_name,
                                                        std::string* log) {
  cudnnBackendDescriptor_t og = p.op_graph->get();
  p.heuristics.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
  cudnnBackendDescriptor_t h = p.heuristics.back()->get();
  set(h, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &og, "heuristics graph");
  set(h, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  const cudnnStatus_t hs = cudnnBackendFinalize(h);
  if (hs != CUDNN_STATUS_SUCCESS) {
    if (log != nullptr) *log += std::string(" ") + mode_name + " finalize: " + status_text(hs) + ";";
    return {};
  }
  int64_t count = 0;
  ck(cudnnBackendGetAttribute(h, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
     "heuristics result count");
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    p.configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(p.configs.back()->get());
  }
  int64_t got = 0;
  if (count > 0) {
    ck(cudnnBackendGetAttribute(h, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                raw.data()),
       "heuristics results");
  }
  raw.resize(static_cast<size_t>(std::max<int64_t>(0, std::min(got, count))));
  if (log != nullptr) {
    *log += std::string(" ") + mode_name + ": " + std::to_string(got) + " engine configs";
    const std::string why_none = last_error();
    if (got == 0 && !why_none.empty()) *log += " (last error: " + why_none + ")";
  }
  return raw;
}

// Heuristics mode A, then the fallback list: the first engine config whose plan finalises (candidate 0).
// Appends what each step gave to `log`.
bool plan_from_heuristics(cudnnHandle_t handle, Plan& p, std::string& log) {
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "heuristics A" : "fallback heuristics";
    const std::vector<cudnnBackendDescriptor_t> raw = heuristic_configs(p, mode, mode_name, &log);
    for (size_t i = 0; i < raw.size(); ++i) {
      if (try_primary(handle, raw[i], p, std::string(mode_name) + " config " + std::to_string(i), log)) {
        if (const std::string sig = config_signature(raw[i]); !sig.empty()) {
          p.candidates.back().label += " (" + sig + ")";
          p.candidates.back().signature = sig;
        }
        return true;
      }
    }
    log += ";";
  }
  return false;
}

// More candidates for `into` from graph `g` (heuristics A, B, fallback; every distinct config that finalises,
// skipping those in `seen`), until `into` has kMaxCandidates or `deadline` passes. Never throws.
void collect_candidates(cudnnHandle_t handle, Plan& g, Plan& into, std::set<std::string>& seen,
                        std::chrono::steady_clock::time_point deadline) {
  try {
    for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_B, CUDNN_HEUR_MODE_FALLBACK}) {
      const char* mode_name = mode == CUDNN_HEUR_MODE_A   ? "heuristics A"
                              : mode == CUDNN_HEUR_MODE_B ? "heuristics B"
                                                          : "fallback heuristics";
      const std::vector<cudnnBackendDescriptor_t> raw = heuristic_configs(g, mode, mode_name, nullptr);
      for (size_t i = 0; i < raw.size(); ++i) {
        if (into.candidates.size() >= kMaxCandidates || std::chrono::steady_clock::now() > deadline) return;
        const std::string sig = config_signature(raw[i]);
        const std::string key = (g.stats ? "stats " : "no stats ") + sig;
        if (sig.empty() || seen.count(key) != 0) continue;  // unknown configs are not timed (may be duplicates)
        seen.insert(key);
        std::string ignored;
        Candidate c;
        std::string label = std::string(mode_name) + " config " + std::to_string(i) + " (" + sig + ")";
        if (&g != &into) label += " [no-stats graph]";
        if (try_config(handle, raw[i], g.stats, label, ignored, c)) {
          c.signature = sig;
          into.candidates.push_back(std::move(c));
        }
      }
    }
  } catch (const Error&) {
    // keep what was collected; candidate 0 is untouched
  }
  (void)last_error();
}

// Every engine cuDNN has for the graph, by global index (what the heuristics would choose from): each engine's
// finalize status with cuDNN's reason, and a plan from the first engine that accepts the graph (its default
// knobs). Appends one entry per distinct status text to `log`.
bool plan_from_engine_list(cudnnHandle_t handle, Plan& p, std::string& log) {
  cudnnBackendDescriptor_t og = p.op_graph->get();
  int64_t count = 0, n = 0;
  const cudnnStatus_t cs = cudnnBackendGetAttribute(og, CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT,
                                                    CUDNN_TYPE_INT64, 1, &n, &count);
  if (cs != CUDNN_STATUS_SUCCESS) {
    log += " engine count: " + status_text(cs) + ";";
    return false;
  }
  log += " engines for this graph: " + std::to_string(count) + " {";
  std::map<std::string, std::string> by_status;  // status text -> engine indices
  bool done = false;
  for (int64_t i = 0; i < count && !done; ++i) {
    auto engine = std::make_unique<Desc>(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    set(engine->get(), CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &og, "engine graph");
    set(engine->get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &i, "engine index");
    const cudnnStatus_t es = cudnnBackendFinalize(engine->get());
    if (es != CUDNN_STATUS_SUCCESS) {
      std::string& ids = by_status[status_text(es)];
      ids += (ids.empty() ? "" : ",") + std::to_string(i);
      continue;
    }
    auto cfg = std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    cudnnBackendDescriptor_t e = engine->get();
    set(cfg->get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &e, "engine config engine");
    const cudnnStatus_t fs = cudnnBackendFinalize(cfg->get());
    if (fs != CUDNN_STATUS_SUCCESS) {
      log += " engine " + std::to_string(i) + " config finalize: " + status_text(fs) + ";";
      continue;
    }
    log += " engine " + std::to_string(i) + " accepts the graph;";
    if (try_primary(handle, cfg->get(), p, "engine " + std::to_string(i) + " (default knobs)", log)) {
      p.configs.clear();
      p.configs.push_back(std::move(cfg));
      p.engine = std::move(engine);
      done = true;
    }
  }
  for (const auto& [status, ids] : by_status) log += " engines " + ids + ": " + status + ";";
  log += " }";
  return done;
}

// Where the cuDNN library this process runs came from, and its version against the headers' (a mismatch is
// worth knowing: run 3 compiled against 9.19 headers and ran a 9.14 libcudnn).
std::string library_report() {
  std::string r = "cuDNN runtime " + std::to_string(cudnnGetVersion()) + ", headers " +
                  std::to_string(CUDNN_VERSION) + ", cudart of cuDNN " + std::to_string(cudnnGetCudartVersion());
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&cudnnGetVersion), &info) != 0 && info.dli_fname != nullptr)
    r += std::string(", library ") + info.dli_fname;
  return r;
}

// With autotuning on: more candidates for p (graph variant vi, candidate 0 found), from its own graph and,
// when the caller has no lse and p's graph writes stats, from the no-stats variant's graph. Never throws;
// candidate 0 stays what it was.
void add_candidates(cudnnHandle_t handle, const AttentionArgs& a, size_t vi, Plan& p) {
  if (!autotune_enabled() || p.candidates.empty()) return;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::microseconds(static_cast<int64_t>(kExtraFinalizeMs * 1000));
  std::set<std::string> seen;
  if (!p.candidates[0].signature.empty())
    seen.insert((p.stats ? "stats " : "no stats ") + p.candidates[0].signature);
  collect_candidates(handle, p, p, seen, deadline);
  if (!a.has_lse() && p.stats) {
    for (size_t wi = 0; wi < kVariants.size(); ++wi) {
      const GraphVariant& w = kVariants[wi];
      if (wi == vi || w.stats || w.p_in_io_type != kVariants[vi].p_in_io_type ||
          w.index_prec != kVariants[vi].index_prec)
        continue;
      try {
        auto g = std::make_unique<Plan>();
        g->stats = false;
        build_graph(handle, a, w, *g);
        const size_t before = p.candidates.size();
        collect_candidates(handle, *g, p, seen, deadline);
        if (p.candidates.size() > before) p.others.push_back(std::move(g));
      } catch (const Error&) {
        // no such graph: nothing added
      }
      break;
    }
  }
  (void)last_error();
  p.tune_pending = p.candidates.size() > 1;
}

std::unique_ptr<Plan> build_plan(cudnnHandle_t handle, const AttentionArgs& a) {
  std::string log;
  for (size_t vi = 0; vi < kVariants.size(); ++vi) {
    const GraphVariant& v = kVariants[vi];
    if (!v.stats && a.has_lse()) continue;  // the caller needs the lse
    auto p = std::make_unique<Plan>();
    p->stats = v.stats;
    p->how = std::string("graph variant ") + std::to_string(vi) + " (" + v.name + ")";
    log += std::string(" | variant ") + std::to_string(vi) + " (" + v.name + "):";
    try {
      build_graph(handle, a, v, *p);
    } catch (const Error& e) {
      log += std::string(" graph: ") + e.what();
      continue;
    }
    if (plan_from_heuristics(handle, *p, log)) {
      add_candidates(handle, a, vi, *p);
      return p;
    }
    // No heuristics result: list the engines (why each refuses; a plan from one that accepts). For every
    // variant, so that a failing run shows which choice changes cuDNN's answer.
    if (plan_from_engine_list(handle, *p, log)) return p;
  }
  const int64_t hq = a.num_q_heads(), hkv = a.num_kv_heads(), s = a.q_len(), d = a.head_dim();
  throw Error("cuDNN has no engine for causal SDPA of this shape (" + std::to_string(hq) + " query heads, " +
              std::to_string(hkv) + " kv heads, S " + std::to_string(s) + ", d " + std::to_string(d) + ", " +
              (a.q.dtype == DType::BF16 ? "bf16" : "f16") + "; " + library_report() + "):" + log);
}

struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::string error;  // why no handle
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::map<PlanKey, std::string> failed;
};

std::mutex& state_mutex() {
  static std::mutex mu;
  return mu;
}

// The current device's state (handle created on first use; never destroyed: process lifetime). Caller holds
// state_mutex().
DeviceState* device_state(std::string* why) {
  static std::map<int, std::unique_ptr<DeviceState>> states;
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    if (why != nullptr) *why = "no CUDA device";
    return nullptr;
  }
  auto it = states.find(dev);
  if (it == states.end()) {
    auto st = std::make_unique<DeviceState>();
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      st->error = "no CUDA device";
    } else {
      const cudnnStatus_t s = cudnnCreate(&st->handle);
      if (s != CUDNN_STATUS_SUCCESS) {
        st->handle = nullptr;
        st->error = "cudnnCreate failed: " + status_text(s);
      }
    }
    it = states.emplace(dev, std::move(st)).first;
  }
  if (it->second->handle == nullptr) {
    if (why != nullptr) *why = it->second->error;
    return nullptr;
  }
  return it->second.get();
}

// The plan of this call, built on first use; nullptr with the reason when cuDNN cannot run it.
Plan* find_plan(const AttentionArgs& a, DeviceState& st, int device, std::string* why) {
  const PlanKey key = key_of(a, device);
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return it->second.get();
  auto f = st.failed.find(key);
  if (f != st.failed.end()) {
    if (why != nullptr) *why = f->second;
    return nullptr;
  }
  try {
    std::unique_ptr<Plan> plan = build_plan(st.handle, a);
    return st.plans.emplace(key, std::move(plan)).first->second.get();
  } catch (const Error& e) {
    st.failed.emplace(key, e.what());
    if (why != nullptr) *why = e.what();
    return nullptr;
  }
}

// Runs candidate c on the call's pointers (q, k, v, out, &scale, unused, stats), asynchronous on the handle's
// stream; the status, never throws.
cudnnStatus_t execute(cudnnHandle_t handle, const Candidate& c, const void* const* ptrs, void* workspace) {
  try {
    float scale = *static_cast<const float*>(ptrs[4]);
    float lowest = std::numeric_limits<float>::lowest();
    // The stats entry last, so that a graph without stats passes the first 6.
    const std::array<int64_t, 7> uids{kUidQ, kUidK, kUidV, kUidO, kUidScale, kUidNegInf, kUidStats};
    const std::array<void*, 7> p{const_cast<void*>(ptrs[0]), const_cast<void*>(ptrs[1]), const_cast<void*>(ptrs[2]),
                                 const_cast<void*>(ptrs[3]), &scale, &lowest, const_cast<void*>(ptrs[6])};
    const int64_t n = c.stats ? 7 : 6;
    void* ws = c.workspace_bytes > 0 ? workspace : nullptr;
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    set(pack.get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data(), "variant pack uids");
    set(pack.get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, p.data(),
        "variant pack pointers");
    set(pack.get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws, "variant pack workspace");
    const cudnnStatus_t fs = cudnnBackendFinalize(pack.get());
    if (fs != CUDNN_STATUS_SUCCESS) return fs;
    return cudnnBackendExecute(handle, c.plan->get(), pack.get());
  } catch (const Error&) {
    return CUDNN_STATUS_BAD_PARAM;
  }
}

std::string ms_text(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f ms", ms);
  return b;
}

// Times p's candidates on the call's buffers (writes out and stats: the real call overwrites them) and keeps
// the fastest in p.chosen; any failure keeps candidate 0. Synchronises `stream`. Skipped (and retried on the
// next call) while the stream is being captured.
void autotune(cudnnHandle_t handle, Plan& p, const void* const* ptrs, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    p.tune_pending = false;
    p.tune_note = ", autotune skipped (stream capture status unknown)";
    return;
  }
  if (capture != cudaStreamCaptureStatusNone) return;  // try again on an uncaptured call
  p.tune_pending = false;
  p.chosen = 0;
  const size_t total = p.candidates.size();
  auto note = [&](const std::string& t) { p.tune_note = ", autotune: " + t; };
  // Workspace: the largest that can be had; candidates needing more are not timed.
  int64_t ws_max = 0;
  for (const Candidate& c : p.candidates) ws_max = std::max(ws_max, c.workspace_bytes);
  try {
    if (static_cast<int64_t>(p.workspace.size()) < ws_max) p.workspace.resize(static_cast<size_t>(ws_max));
  } catch (const Error&) {
    try {
      if (static_cast<int64_t>(p.workspace.size()) < p.candidates[0].workspace_bytes)
        p.workspace.resize(static_cast<size_t>(p.candidates[0].workspace_bytes));
    } catch (const Error&) {
      note("skipped (no workspace)");
      return;
    }
  }
  const int64_t ws_have = static_cast<int64_t>(p.workspace.size());
  cudaEvent_t ev[2] = {nullptr, nullptr};
  if (cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess) {
    (void)cudaGetLastError();
    for (cudaEvent_t e : ev)
      if (e != nullptr) cudaEventDestroy(e);
    note("skipped (no CUDA events)");
    return;
  }
  // Mean time of `reps` back-to-back runs of candidate i; negative when it failed.
  auto time_of = [&](size_t i, int reps) -> double {
    if (cudaEventRecord(ev[0], stream) != cudaSuccess) return -1;
    for (int r = 0; r < reps; ++r)
      if (execute(handle, p.candidates[i], ptrs, p.workspace.data()) != CUDNN_STATUS_SUCCESS) {
        (void)last_error();
        (void)cudaStreamSynchronize(stream);
        return -1;
      }
    float ms = 0;
    if (cudaEventRecord(ev[1], stream) != cudaSuccess || cudaEventSynchronize(ev[1]) != cudaSuccess ||
        cudaEventElapsedTime(&ms, ev[0], ev[1]) != cudaSuccess)
      return -1;
    return static_cast<double>(ms) / reps;
  };
  const double budget = autotune_budget_ms();
  const double t_warm = time_of(0, 1);  // warm-up of candidate 0, and the run time estimate
  std::string result;
  if (t_warm <= 0) {
    result = "skipped (warm-up of config 0 failed)";
  } else if (3 * t_warm > budget) {  // room for at least config 0 and one other after the warm-up
    result = "skipped (one run " + ms_text(t_warm) + ", budget " + ms_text(budget) +
             " (TESSERA_CUDNN_AUTOTUNE_BUDGET_MS); " + std::to_string(total) + " candidates)";
  } else {
    const size_t m = std::min(total, static_cast<size_t>((budget - t_warm) / t_warm));
    const int reps = std::clamp(static_cast<int>((budget - t_warm) / (t_warm * static_cast<double>(m))), 1, 3);
    std::vector<double> t(m, -1);
    for (size_t i = 0; i < m; ++i)
      if (p.candidates[i].workspace_bytes <= ws_have) t[i] = time_of(i, reps);
    if (t[0] <= 0) {
      result = "skipped (config 0 failed when timed)";
    } else {
      size_t best = 0;
      for (size_t i = 1; i < m; ++i)
        if (t[i] > 0 && t[i] < t[best]) best = i;
      p.chosen = best;
      result = p.candidates[best].label + ", candidate " + std::to_string(best) + " of " + std::to_string(total) +
               (best == 0 ? ", kept: " : ", autotuned: ") + ms_text(t[best]) + " vs " + ms_text(t[0]) +
               " config 0 (" + std::to_string(m) + " timed, " + std::to_string(reps) + " rep(s) each; times:";
      for (size_t i = 0; i < m; ++i) result += " " + (t[i] > 0 ? ms_text(t[i]) : std::string("failed"));
      result += ")";
    }
  }
  (void)cudaStreamSynchronize(stream);
  (void)cudaGetLastError();
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  note(result);
}

}  // namespace

bool cudnn_built() {
  return true;
}

int cudnn_version() {
  return static_cast<int>(cudnnGetVersion());
}

bool cudnn_available(std::string* why) {
  const std::lock_guard<std::mutex> lock(state_mutex());
  std::string reason;
  if (device_state(&reason) == nullptr) {
    if (why != nullptr) *why = reason;
    return false;
  }
  if (why != nullptr) *why = library_report();
  return true;
}

bool cudnn_dense_plan(const AttentionArgs& a, std::string* why) {
  if (!cudnn_dense_supports(a, why)) return false;
  const std::lock_guard<std::mutex> lock(state_mutex());
  DeviceState* st = device_state(why);
  if (st == nullptr) return false;
  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  const Plan* plan = find_plan(a, *st, dev, why);
  if (plan != nullptr && why != nullptr) {
    *why = plan->how;
    if (plan->tune_pending) {
      *why += ", autotune pending (" + std::to_string(plan->candidates.size()) + " candidates, timed on the first call)";
    } else if (!plan->tune_note.empty()) {
      *why += plan->tune_note;
    } else if (plan->candidates.size() <= 1) {
      *why += autotune_enabled() ? ", autotune: single candidate" : ", autotune off (TESSERA_CUDNN_AUTOTUNE=1 turns it on)";
    }
  }
  return plan != nullptr;
}

void cudnn_dense_attention(const AttentionArgs& a, cudaStream_t stream) {
  std::string why;
  check(cudnn_dense_supports(a, &why), "CUDA attention (cuDNN dense): " + why);
  const std::lock_guard<std::mutex> lock(state_mutex());
  DeviceState* st = device_state(&why);
  check(st != nullptr, "CUDA attention (cuDNN dense): cuDNN unavailable: " + why);
  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  Plan* plan = find_plan(a, *st, dev, &why);
  check(plan != nullptr, "CUDA attention (cuDNN dense): " + why);

  void* stats = a.lse.data;
  if (stats == nullptr && plan->stats) {
    plan->stats_scratch.resize(static_cast<size_t>(a.num_q_heads() * a.q_len()));
    stats = plan->stats_scratch.data();
  }
  const float scale = a.effective_scale();
  const void* const ptrs[] = {a.q.data, a.k.data, a.v.data, a.out.data, &scale, nullptr, stats};
  ck(cudnnSetStream(st->handle, stream), "set stream");
  if (plan->tune_pending) {
    try {
      autotune(st->handle, *plan, ptrs, stream);
    } catch (const std::exception& e) {  // never fails the call: candidate 0, as without autotuning
      plan->tune_pending = false;
      plan->chosen = 0;
      plan->tune_note = std::string(", autotune failed (") + e.what() + "), config 0 kept";
    }
  }
  Candidate& c = plan->candidates[plan->chosen];
  if (static_cast<int64_t>(plan->workspace.size()) < c.workspace_bytes)
    plan->workspace.resize(static_cast<size_t>(c.workspace_bytes));
  ck(execute(st->handle, c, ptrs, plan->workspace.data()), "execute SDPA plan");
}

#endif  // TESSERA_HAS_CUDNN

}  // namespace tessera::attn::gpu

# Pulls the device index build's kernels (lower_cuda.cu, its anonymous namespace) into lower_extracted.h for the
# host emulation (run.sh).
import os, sys
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..')
out_dir = sys.argv[1] if len(sys.argv) > 1 else '.'
cu = open(os.path.join(root, 'src/attention/cuda/lower_cuda.cu')).read()
a = cu.index('struct LowerParams {')
b = cu.index('}  // namespace\n\nconst char* index_build_mode_name')
out = '''#include "vs_shim.h"
#include "attention/cuda/lower_tile.h"
namespace tessera::attn::gpu {
''' + cu[a:b] + '''
}  // namespace tessera::attn::gpu
'''
open(os.path.join(out_dir, 'lower_extracted.h'), 'w').write(out)

# VsTopK (estimate_cuda.cu) with order_key (block_topk.cuh) into topk_extracted.h
est = open(os.path.join(root, 'src/attention/cuda/estimate_cuda.cu')).read()
tk = open(os.path.join(root, 'src/attention/cuda/block_topk.cuh')).read()
ok = tk[tk.index('__device__ __forceinline__ uint32_t order_key'):tk.index('// Exact top-k of one row by one warp')]
a = est.index('struct VsTopK {')
b = est.index('__global__ void __launch_bounds__(kTopKThreads) vs_topk_kernel')
kt = est[est.index('constexpr int kTopKThreads'):]
kt = kt[:kt.index('\n') + 1]
out = '''#include "vs_shim.h"
namespace tessera::attn::gpu {
namespace detail {
''' + ok + '''}  // namespace detail
''' + kt + est[a:b] + '''}  // namespace tessera::attn::gpu
'''
open(os.path.join(out_dir, 'topk_extracted.h'), 'w').write(out)

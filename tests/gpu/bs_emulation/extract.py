# Pulls the BS estimator's device code (estimate_cuda.cu from `struct BsParams` to launch_vs, the BS descriptors
# of estimate_cuda.h, order_key and WarpTopK of block_topk.cuh, the host plan of the DeviceEstimates constructor)
# into bs_extracted.h / bs_plan.inc for the host emulation (see run.sh).
import os, sys
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..')
out_dir = sys.argv[1] if len(sys.argv) > 1 else '.'
cu=open(os.path.join(root, 'src/attention/cuda/estimate_cuda.cu')).read()
h=open(os.path.join(root, 'src/attention/cuda/estimate_cuda.h')).read()
tk=open(os.path.join(root, 'src/attention/cuda/block_topk.cuh')).read()
# structs from header
hs=h[h.index('struct BsHeadDesc {'):h.index('class DeviceEstimates')]
# BS section
a=cu.index('struct BsParams {')
b=cu.index('template <typename T, int D>\nvoid launch_vs')
bs=cu[a:b]
bs=bs.replace('extern __shared__ __align__(16) float bs_ktile[];','extern float bs_ktile[];')
# replace asm select
i=bs.index('__device__ __forceinline__ float bs_select(bool p, float a, float b) {')
j=bs.index('\n}\n',i)+3
bs=bs[:i]+'inline float bs_select(bool p, float a, float b) { return p ? a : b; }\n'+bs[j:]
# order_key and WarpTopK
ok=tk[tk.index('__device__ __forceinline__ uint32_t order_key'):tk.index('// Exact top-k of one row by one warp')]
wt=tk[tk.index('template <int kRegSlots>\nstruct WarpTopK'):tk.rindex('}  // namespace tessera::attn::gpu::detail')]
out='''#include "shim.h"
namespace tessera::attn::gpu {
'''+hs+'''
namespace detail {
'''+ok+wt+'''
}  // namespace detail
alignas(16) float bs_ktile[2 * 32 * 1024 / 4];
'''+bs+'''
}  // namespace tessera::attn::gpu
'''
open(os.path.join(out_dir, 'bs_extracted.h'),'w').write(out)
# the host plan block of the constructor
a=cu.index('  std::vector<BsTileDesc> bs_tiles;')
b=cu.index('if (static_cast<int32_t>(bs_tiles.size()) > wave.tile_begin) close_wave();\n  }')+len('if (static_cast<int32_t>(bs_tiles.size()) > wave.tile_begin) close_wave();\n  }')
plan=cu[a:b]
open(os.path.join(out_dir, 'bs_plan.inc'),'w').write(plan+'\n')

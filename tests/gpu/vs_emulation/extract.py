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

# Pulls the VS estimate's score/stats/sums kernels (estimate_cuda.cu from `constexpr int kVsRows` to the top-k,
# of the working tree and of a second revision, e.g. the one before a change) with the mma_sm80.cuh helpers they
# use into sums_extracted.h, one namespace per revision (cur, ref), for sums.cpp (sums_run.sh).
# Usage: python3 sums_extract.py OUT_DIR REF_SOURCE_FILE
import os, sys
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..')
out_dir, ref_path = sys.argv[1], sys.argv[2]
mma = open(os.path.join(root, 'src/attention/cuda/mma_sm80.cuh')).read()
helpers = mma[mma.index('// Element offset of (row, 16-byte chunk)'):mma.index('// o[D/8][4] += P')]
helpers += mma[mma.index('// Copies rows [0, ROWS)'):mma.index('}  // namespace tessera::attn::gpu::detail')]
hdr = open(os.path.join(root, 'src/attention/cuda/estimate_cuda.h')).read()
desc = hdr[hdr.index('struct VsHeadDesc {'):hdr.index('struct BsHeadDesc {')]


def vs_part(src):
    a = src.index('constexpr int kVsRows')
    b = src.index('// Exact top-k of one row')
    s = src[a:b]
    return s.replace('extern __shared__ __align__(128) unsigned char smem[];',
                     'unsigned char* smem = vsemu::detail::arena();')


cur = vs_part(open(os.path.join(root, 'src/attention/cuda/estimate_cuda.cu')).read())
ref = vs_part(open(ref_path).read())
out = '''#include "sums_shim.h"
namespace vsemu {
namespace detail {
''' + helpers + '''}  // namespace detail
''' + desc + '''
namespace cur {
using namespace vsemu::detail;
''' + cur + '''}  // namespace cur
namespace ref {
using namespace vsemu::detail;
''' + ref + '''}  // namespace ref
}  // namespace vsemu
'''
open(os.path.join(out_dir, 'sums_extracted.h'), 'w').write(out)

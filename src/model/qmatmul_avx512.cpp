#include "model/qmatmul_kernels.h"
namespace tessera::model::qmm {
const Kernels* avx512_kernels() {
  return nullptr;
}
}  // namespace tessera::model::qmm

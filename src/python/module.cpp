// tessera._tessera: the module's entry point (bindings.h).
#include <nanobind/nanobind.h>

#include "core/error.h"
#include "python/bindings.h"

namespace nb = nanobind;

namespace tessera::python {

bool built_with_cuda() {
#ifdef TESSERA_PY_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace tessera::python

NB_MODULE(_tessera, m) {
  m.doc() =
      "tessera's C++ core: models, the engine and the attention ops (use the package `tessera`, not this "
      "module)";
  // tessera::Error -> tessera.Error (a RuntimeError subclass), message unchanged.
  nb::exception<tessera::Error>(m, "Error", PyExc_RuntimeError);
  m.attr("built_with_cuda") = tessera::python::built_with_cuda();
  m.attr("__version__") = TESSERA_VERSION;  // the project's version (CMakeLists.txt project()), as `tessera --version`
  tessera::python::register_model(m);
  tessera::python::register_engine(m);
  tessera::python::register_ops(m);
}

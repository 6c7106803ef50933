// tessera/python/bindings.h — the parts of the Python module tessera._tessera, one register function per
// file.
//
// The module is thin: models load through the CLI's Session (so Python and `tessera run` tokenize, template
// and build policies identically), the engine is runtime::Engine (or the GPU engine), and the attention ops
// run the same executors as the engine on the caller's memory (DLPack, no copy). Every tessera::Error becomes
// tessera.Error (a RuntimeError) with the same message.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>

#include "cli/session.h"

namespace tessera::python {

// Every binding file's spelling of nanobind, and its "name"_a argument literals.
namespace nb = nanobind;
using namespace nanobind::literals;

// A loaded model shared by the Python Model object and every Engine made from it (an Engine keeps it alive).
struct ModelHandle {
  std::shared_ptr<const cli::Session> session;
};

void register_model(nanobind::module_& m);   // Model, Policy, spec checks
void register_engine(nanobind::module_& m);  // Engine, Generation
void register_ops(nanobind::module_& m);     // attention ops over DLPack tensors

// Whether this build has the CUDA backend and the GPU engine.
bool built_with_cuda();

}  // namespace tessera::python

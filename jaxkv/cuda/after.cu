// An ordering edge with no kernel: buffers passed through unchanged once other values exist.
//
// A jitted step reads a pool and then updates it in place; XLA must see the update depend on
// the read, or it copies the pool. This handler takes the pools and the reads' results and
// returns the pools, aliased to its inputs (jax's input_output_aliases), so the step gets the
// dependency without a launch. Reached through jax.ffi (jaxkv.kernels.after).

#include <cuda_runtime.h>

#include "ffi_handler.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

namespace ffi = xla::ffi;

// args: the n passed buffers, then the values waited for; rets: the n passed buffers. Only
// enqueues work (none, unless XLA ever hands a result that is not its input), so it is
// marked command-buffer compatible.
static ffi::Error pass_after(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() < rets.size()) return ffi::Error::InvalidArgument("after: expected the passed buffers first");
  for (size_t i = 0; i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("after: expected array buffers");
    if (in->size_bytes() != (*out)->size_bytes())
      return ffi::Error::InvalidArgument("after: each result must be its input's shape");
    in_place(*out, *in, stream);
  }
  return launch_status(cudaGetLastError(), "after");
}

}  // namespace jaxkv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvAfter, jaxkv::pass_after,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

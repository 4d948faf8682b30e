// FFI handlers that update a buffer in place: jax passes it with input_output_aliases, so
// XLA hands the same buffer in and out. Should it ever not, copy the input into the output
// first, on the stream, so the kernel's in-place update still starts from the input.
#pragma once

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

template <class Out, class In>  // Out: an ffi::Result<...> of In's buffer type
inline void in_place(Out& out, const In& in, cudaStream_t stream) {
  if (out->untyped_data() != in.untyped_data())
    cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), in.size_bytes(), cudaMemcpyDeviceToDevice, stream);
}

}  // namespace jaxkv

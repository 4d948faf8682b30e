// What the XLA FFI handlers of the cuda/ kernels share.
#pragma once

#include <string>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

// Handlers that update a buffer in place: jax passes it with input_output_aliases, so XLA
// hands the same buffer in and out. Should it ever not, copy the input into the output
// first, on the stream, so the kernel's in-place update still starts from the input.
template <class Out, class In>  // Out: an ffi::Result<...> of In's buffer type
inline void in_place(Out& out, const In& in, cudaStream_t stream) {
  if (out->untyped_data() != in.untyped_data())
    cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), in.size_bytes(), cudaMemcpyDeviceToDevice, stream);
}

// Whether the current device is Hopper (sm_90): the wgmma kernels are built for sm_90a only,
// and their handlers refuse other devices with a clear error instead of the kernel's trap.
inline bool on_hopper() {
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  return major == 9;
}

// The handler's result for a launch that returned ``e`` (cudaGetLastError after it).
inline xla::ffi::Error launch_status(cudaError_t e, const char* kernel) {
  if (e != cudaSuccess) return xla::ffi::Error::Internal(std::string("jaxkv ") + kernel + ": " + cudaGetErrorString(e));
  return xla::ffi::Error::Success();
}

}  // namespace jaxkv

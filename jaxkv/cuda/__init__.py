"""The CUDA kernels (the ``.cu`` sources in this directory, shipped with the package):
built with nvcc on first use (``build.library``) and registered as XLA FFI targets, so
jitted JAX reaches them through ``jax.ffi`` (``jaxkv.kernels``) and PyTorch through
``ctypes`` (``torch_bridge.kernels``), on the same buffers. See docs/kernels/building.md.
"""

from __future__ import annotations

import functools

from jaxkv.cuda.build import ARCHS, BuildError, arch_of, check_compile, library, library_path
from jaxkv.formats.storage import STORAGE_CODES  # the kernels' storage-family argument (enum Storage)

# FFI target name -> exported handler symbol (flush_write.cu unless named)
FFI_TARGETS = {
    "jaxkv_flush_write_csa": "JaxkvFlushWriteCsa",
    "jaxkv_flush_write_hca": "JaxkvFlushWriteHca",
    "jaxkv_window_write": "JaxkvWindowWrite",
    "jaxkv_encode_rows": "JaxkvEncodeRows",
    "jaxkv_csa_rotate_state": "JaxkvCsaRotateState",
    "jaxkv_hca_reset_state": "JaxkvHcaResetState",
    "jaxkv_dequant_gather": "JaxkvDequantGather",  # dequant_gather.cu
    "jaxkv_compress_decode_csa": "JaxkvCompressDecodeCsa",  # compress_decode.cu
    "jaxkv_compress_decode_hca": "JaxkvCompressDecodeHca",
    "jaxkv_mxfp4_pack": "JaxkvMxfp4Pack",  # fp4_pack.cu
    "jaxkv_nvfp4_pack": "JaxkvNvfp4Pack",
    "jaxkv_pool_attention": "JaxkvPoolAttention",  # pool_attention.cu
    "jaxkv_prefix_attention": "JaxkvPrefixAttention",  # prefix_attention.cu
    "jaxkv_prefix_attention_fp8": "JaxkvPrefixAttentionFp8",
    "jaxkv_top_k": "JaxkvTopK",  # top_k.cu
    "jaxkv_top_k_record": "JaxkvTopKRecord",
    "jaxkv_index_scores": "JaxkvIndexScores",  # index_scores.cu
    "jaxkv_index_query": "JaxkvIndexQuery",  # index_query.cu
    "jaxkv_after": "JaxkvAfter",  # after.cu
    "jaxkv_move_rows": "JaxkvMoveRows",  # move_rows.cu
    "jaxkv_frame_write_fp8": "JaxkvFrameWriteFp8",  # frame_write_fp8.cu
    "jaxkv_entry_rows": "JaxkvEntryRows",  # entry_rows.cu
}


def device_arch() -> str:
    """The arch of jax's first GPU ("90a" on an H100); ValueError without one."""
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        raise ValueError("impl='cuda': expected a CUDA GPU visible to jax, found none (use impl='xla')")
    return arch_of(gpus[0].compute_capability)


@functools.cache
def register_ffi_targets() -> str:
    """Build (or load from the cache) the library for this GPU and register its FFI
    targets with jax, once per process. Returns the arch."""
    import jax

    arch = device_arch()
    lib = library(arch)
    for name, symbol in FFI_TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
    return arch


def call_in_place(target: str, bufs, *, before=(), after=(), **attrs) -> tuple:
    """``bufs`` through the FFI target ``target``, updated in place: the non-empty ones are
    passed between ``before`` and ``after`` and aliased to the results (empty ones come back
    as they are; XLA has no buffer for them). Registers the targets first."""
    import jax

    live = [i for i, b in enumerate(bufs) if b.size]
    if not live:
        return tuple(bufs)
    register_ffi_targets()
    passed = [bufs[i] for i in live]
    out = jax.ffi.ffi_call(
        target,
        tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in passed),
        input_output_aliases={len(before) + k: k for k in range(len(passed))},
    )(*before, *passed, *after, **attrs)
    result = list(bufs)
    for k, i in enumerate(live):
        result[i] = out[k]
    return tuple(result)


__all__ = [
    "ARCHS",
    "BuildError",
    "FFI_TARGETS",
    "STORAGE_CODES",
    "arch_of",
    "call_in_place",
    "check_compile",
    "device_arch",
    "library",
    "library_path",
    "register_ffi_targets",
]

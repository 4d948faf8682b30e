"""The torch drop-in's attention backends: what the registry needs to choose one, and each
backend's attention over the manager's buffers.

The names, the ``auto`` rule and the checks are ``jaxkv._backend``'s ``torch.attention``
operation; ``backend_context`` tells it what the torch side knows. With exact pages the
visible keys of every block are rows ``[0, n)`` of its ``[T, H, D]`` buffers, ``n`` from
the host mirror (``Pages.visible_rows``):

* ``Sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over the views ``k[:n]``,
  ``v[:n]`` (no copy; torch picks its kernel). CPU and CUDA, any dtype; with ``force_fp32``
  it runs in float32, as lingbot-map's FlashInferKVCacheManager's fp32 path (a gather and
  an fp32 SDPA) does.
* ``CudaPrefix``: jaxkv's ``jaxkv/cuda/prefix_attention.cu`` (the kernel of
  ``frame.attention(impl="cuda")``) over rows ``[0, n)``, launched by ctypes on torch's
  stream: no page table, no JAX dispatch; planned once per frame step (n, key splits), one
  launch per block. sm_90, bf16, head_dim 64.
* ``FlashInferPrefix``: ``flashinfer.single_prefill_with_kv_cache`` over the same views: no
  plan, no page table. CUDA.
* ``FlashInferPaged``: lingbot-map's paged prefill (``BatchPrefillWithPagedKVCacheWrapper``,
  planned once per frame step, run per block), FA2 or FA3; FA3 uses power-of-two pages
  whose zero padding rows it attends, as lingbot-map does.

Not backends, by decision (docs/torch.md): jaxkv's Mosaic GPU prefix kernel on the JAX
arrays through DLPack (exporting a fresh JAX output blocks the host until its kernel ends),
and cuDNN through torch (torch caches a graph per shape, and the key length changes every frame).
"""

from __future__ import annotations

import torch

from jaxkv import _backend
from jaxkv.kernels.launch import prefix_cuda_splits, sm_count
from torch_bridge import kernels

try:
    import flashinfer

    FLASHINFER_AVAILABLE = True
except ImportError:  # the prefix backend "sdpa" is used instead
    flashinfer = None
    FLASHINFER_AVAILABLE = False

DTYPES = {  # the storage dtypes, as jaxkv.frame.FrameSpec names them
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
}
BACKENDS = _backend.choices("torch.attention")  # "auto" first
PREFIX_BACKENDS = ("sdpa", "cuda", "flashinfer")  # attend the prefix views k[:n], v[:n]
FLASHINFER_PREFIX_KERNEL = "auto"  # ``backend=`` of flashinfer.single_prefill_with_kv_cache ("auto", "fa2", "fa3")


def backend_context(
    device, dtype, head_dim: int, *, force_fp32: bool = False, fa3: bool = False, tokens_per_frame: int = 0
) -> dict:
    """What the registry's ``torch.attention`` operation reads about ``device`` and the cache:
    whether FlashInfer imports and the cuda kernel runs there, the storage dtype, the flags."""
    device = torch.device(device)
    return dict(
        device=str(device),
        flashinfer=FLASHINFER_AVAILABLE,
        cuda_kernel=kernels.prefix_attention_available(device),
        dtype=DTYPES.get(dtype, str(dtype)),
        head_dim=head_dim,
        force_fp32=force_fp32,
        fa3=fa3,
        tokens_per_frame=tokens_per_frame,
    )


class Backend:
    """One backend's attention: ``backend(q, k, v, paged, pages)`` for one block, q
    ``[q_len, H, D]``, k / v that block's ``[T, H, D]`` buffers, paged their ``[pages,
    page_size, H, D]`` views, pages the host mirror. ``reset()`` forgets the last plan.
    ``reads_fp8``: it takes an FP8 cache's codes with ``scales=(k_scale, v_scale)`` in place;
    the others get the visible rows dequantized."""

    reads_fp8 = False

    def reset(self) -> None:
        pass

    def __call__(self, q, k, v, paged, pages) -> torch.Tensor:
        raise NotImplementedError


class Sdpa(Backend):
    def __call__(self, q, k, v, paged, pages):
        n = pages.visible_rows()
        k, v = k[:n].transpose(0, 1)[None], v[:n].transpose(0, 1)[None]  # [1, H, n, D] views
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v)
        return out[0].transpose(0, 1).contiguous()


class CudaPrefix(Backend):
    """Planned once per frame step (the visible rows follow from the page counters), then one
    launch per block over the whole buffers, of which rows ``[0, n)`` are read (FP8 codes too)."""

    reads_fp8 = True

    def __init__(self, device, heads: int, jax_device):
        self.prefix = kernels.PrefixAttention(device, heads, heads)
        self.sms = sm_count(jax_device)
        self.planned = None

    def reset(self):
        self.planned = None

    def __call__(self, q, k, v, paged, pages, scales=(None, None)):
        step = (pages.c, q.shape[0])
        if self.planned != step:
            n = pages.visible_rows()
            self.prefix.plan(q.shape[0], n, prefix_cuda_splits(q.shape[0], q.shape[1], n, self.sms))
            self.planned = step
        return self.prefix.run(q.contiguous(), k, v, k_scale=scales[0], v_scale=scales[1])


class FlashInferPrefix(Backend):
    def __call__(self, q, k, v, paged, pages):
        n = pages.visible_rows()
        return flashinfer.single_prefill_with_kv_cache(
            q.contiguous(), k[:n], v[:n], causal=False, kv_layout="NHD", backend=FLASHINFER_PREFIX_KERNEL
        )


class FlashInferPaged(Backend):
    """FlashInfer's paged prefill; the plan is a function of the page counters alone, so it is
    made once per frame step, also on a non-keyframe, whose per-block append + rollback
    brings the same counters back."""

    def __init__(self, variant: str, device, heads: int, head_dim: int, dtype, page_size: int, tokens_per_frame: int):
        self.device, self.heads, self.head_dim, self.dtype, self.page_size = device, heads, head_dim, dtype, page_size
        self.workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD", backend=variant)
        self.qo_indptr = torch.tensor([0, tokens_per_frame], dtype=torch.int32)  # host: plan needs no sync
        self.planned = None  # the page counters of the last plan
        self.plan_done = None  # CUDA event recorded after the last plan()

    def reset(self):
        self.planned = None

    def __call__(self, q, k, v, paged, pages):
        if self.planned != pages.c:
            self.plan(pages)
        return self.wrapper.run(q.contiguous(), paged)

    def plan(self, pages) -> None:
        # plan() fills a pinned host buffer of FlashInfer's and enqueues an asynchronous copy
        # from it, which the next plan() overwrites: wait for the previous plan's copy first
        # (the frame's one host sync; by then the GPU is long past it).
        if self.plan_done is not None:
            self.plan_done.synchronize()
            self.plan_done = None
        # Pinned host -> device without a stream sync (plan() would copy pageable host ids
        # synchronously); torch's host allocator keeps the pinned block until the copy ran.
        indices = torch.tensor(pages.page_ids(), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        indices = indices.to(self.device, non_blocking=True)
        self.wrapper.plan(
            self.qo_indptr,
            torch.tensor([0, pages.num_pages()], dtype=torch.int32),
            indices,
            torch.tensor([pages.last_page_len()], dtype=torch.int32),
            num_qo_heads=self.heads,
            num_kv_heads=self.heads,
            head_dim_qk=self.head_dim,
            page_size=self.page_size,
            causal=False,
            pos_encoding_mode="NONE",
            q_data_type=self.dtype,
        )
        if self.device.type == "cuda":
            self.plan_done = torch.cuda.Event()
            self.plan_done.record(torch.cuda.current_stream(self.device))
        self.planned = pages.c


def make(
    backend: str, *, device, jax_device, heads: int, head_dim: int, dtype, page_size: int, tokens_per_frame: int
) -> Backend:
    """The ``Backend`` for a name the registry chose (not ``"auto"``)."""
    if backend == "sdpa":
        return Sdpa()
    if backend == "cuda":
        return CudaPrefix(device, heads, jax_device)
    if backend == "flashinfer":
        return FlashInferPrefix()
    variant = backend.rsplit("-", 1)[1]  # flashinfer-paged-fa2 / -fa3
    return FlashInferPaged(variant, device, heads, head_dim, dtype, page_size, tokens_per_frame)


__all__ = [
    "BACKENDS",
    "DTYPES",
    "FLASHINFER_AVAILABLE",
    "PREFIX_BACKENDS",
    "Backend",
    "CudaPrefix",
    "FlashInferPaged",
    "FlashInferPrefix",
    "Sdpa",
    "backend_context",
    "make",
]

"""Prefix attention: every query attends to the keys ``[0, kv_len)`` of its buffer (Hopper).

cuDNN's flash attention pays more when told a key length (its padding-mask kernel), even
when the length covers the whole buffer (docs/kernels/prefix_attention.md). A frame
cache's visible keys are a prefix of a fixed-capacity buffer, so every call needs a length.
This kernel takes it as data: the key loop runs ``ceil(kv_len / block_kv)`` steps and only
the last step is masked, so a length costs nothing.

Design (FlashAttention-3's warp specialization, written with Pallas' Mosaic GPU lowering;
JAX's ``pallas/ops/gpu/attention_mgpu.py`` is the pattern): each program owns 128 queries
of one head and one key chunk; two compute warpgroups (64 queries each) run QK^T and PV on
the tensor cores (``wgmma``) with an online softmax in registers, ping-ponged by a barrier;
a third warpgroup streams K/V blocks into shared memory by TMA, ``stages`` blocks ahead (both from ``launch``).

    q: dtype[B, Tq, Hq, D]       queries (Tq padded to a multiple of 128 here)
    k, v: dtype[B, T, H, D]      key/value buffers (Hq a multiple of H: GQA), T = splits x chunk
    kv_len: i32[B]               visible prefix of each batch entry's buffer (clamped to [0, T])
    -> out dtype[B, Tq, Hq, D]   zeros where kv_len == 0

Rows at or past ``kv_len`` get no weight. The CUDA kernel zero-fills them, so nothing they
hold reaches the output. The Mosaic GPU kernel loads the last key block whole: the entry's own
rows from ``kv_len`` to the next ``block_kv`` boundary enter ``P V`` with weight 0, so they
must be finite (0 x NaN is NaN); no row of another entry, and none past that boundary, is
read (docs/reliability.md).

``splits`` > 1 cuts each buffer into equal key chunks handled by separate programs (few
queries make few programs; ``jaxkv.kernels.launch.prefix_splits`` picks the count) and
merges them by their log-sum-exp.
``ref_prefix_attention`` is the float32 reference with the same contract. Mosaic GPU only
(no interpret mode): the tests run it on a GPU.

``prefix_attention_cuda`` is the same contract on ``jaxkv/cuda/prefix_attention.cu`` through
``jax.ffi`` (bf16, head_dim 64, sm_90): the same warp-specialized design written in CUDA,
which is also what PyTorch callers launch on torch's stream (``torch_bridge.kernels``). It
also reads an FP8 frame cache in place: k, v ``float8_e4m3fn[B, T, H, D]`` with their
``k_scale``, ``v_scale`` ``bf16[B, T, H]`` (``jaxkv.formats.quantize_fp8_rows``), decoded to
bf16 in shared memory as they stream in (docs/kernels/frame_cache_fp8.md).
``ref_prefix_attention`` takes the same scales.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.cuda import register_ffi_targets
from jaxkv.formats.fp8 import dequantize_fp8_rows
from jaxkv.kernels.launch import launch
from jaxkv.math.attention import merge_partials, ref_attention

BLOCK_Q = 64  # queries per compute warpgroup (the wgmma M tile); a program holds 2 x BLOCK_Q
LOG2E = math.log2(math.e)
i32 = jnp.int32


def _check(q, k, v, kv_len, splits, scales=None):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"q, k, v: expected [B, Tq, Hq, D] and two [B, T, H, D] alike, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, _, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or Hq % k.shape[2]:
        raise ValueError(f"k: expected [{B}, T, H, {D}] with {Hq} a multiple of H, got {tuple(k.shape)}")
    if scales is not None:
        _check_fp8(q, k, v, scales)
    elif not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"q, k, v: expected one dtype, bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if D % 64:
        raise ValueError(f"q: expected head_dim a multiple of 64, got {D}")
    if kv_len.shape != (B,) or kv_len.dtype != jnp.int32:
        raise ValueError(f"kv_len: expected int32[{B}], got {kv_len.dtype}{list(kv_len.shape)}")
    if splits < 1 or k.shape[1] % (splits * 64):
        raise ValueError(f"splits: {k.shape[1]} key rows do not split into {splits} chunks of whole 64-row blocks")


def _check_fp8(q, k, v, scales):
    """An FP8 cache's operands: bf16 queries, E4M3 codes, a bf16 scale per row and head."""
    if q.dtype != jnp.bfloat16 or k.dtype != jnp.float8_e4m3fn or v.dtype != jnp.float8_e4m3fn:
        raise ValueError(
            f"q, k, v: expected bfloat16 queries over float8_e4m3fn K/V (an FP8 cache), got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    for name, x in zip(("k_scale", "v_scale"), scales):
        if x is None or x.shape != k.shape[:3] or x.dtype != jnp.bfloat16:
            got = "None" if x is None else f"{x.dtype}{list(x.shape)}"
            raise ValueError(f"{name}: expected bfloat16{list(k.shape[:3])} (a scale per row and head), got {got}")


def ref_prefix_attention(q, k, v, kv_len, *, scale=None, k_scale=None, v_scale=None):
    """float32 softmax attention over the keys ``[0, kv_len)``; zeros where kv_len == 0.

    q: float[B, Tq, Hq, D]; k, v: float[B, T, H, D], or float8_e4m3fn with
    k_scale, v_scale: bf16[B, T, H] (dequantized in float32); kv_len: i32[B] -> float32[B, Tq, Hq, D]
    """
    if k_scale is not None:
        k, v = (dequantize_fp8_rows(x, s, jnp.float32) for x, s in ((k, k_scale), (v, v_scale)))
    mask = jnp.arange(k.shape[1], dtype=jnp.int32)[None] < kv_len[:, None]
    k, v = (jnp.where(mask[:, :, None, None], x, 0) for x in (k, v))  # masked rows' bytes (NaN too) never count
    return ref_attention(q, k, v, mask, scale)


def _block_kv(chunk: int) -> int:
    return next(b for b in (launch("prefix_attention")["block_kv"], 128, 64) if chunk % b == 0)


def _partials(q, k, v, kv_len, scale, splits):
    """-> out dtype[B*splits, Tq, Hq, D], lse2 f32[B*splits, Hq, Tq] (base 2; -inf: no keys)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, Tq, Hq, D = q.shape
    T, H = k.shape[1], k.shape[2]
    G = Hq // H
    chunk = T // splits
    block_kv = _block_kv(chunk)
    stages = max(1, min(launch("prefix_attention")["stages"], chunk // block_kv))
    dtype = q.dtype
    c = scale * LOG2E  # logits in base 2: exp(s * scale) = exp2(s * c)

    def kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, scoped):
        bn, head, wg = lax.axis_index("chunk"), lax.axis_index("heads"), lax.axis_index("wg")
        b, start = lax.div(bn, i32(splits)), lax.rem(bn, i32(splits)) * chunk
        length = jnp.clip(jnp.clip(len_ref[b], 0, T) - start, 0, chunk)
        steps = lax.div(length + (block_kv - 1), i32(block_kv))
        (qo_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), (k_free, v_free), turn = scoped

        def take_turn():  # the two compute warpgroups alternate on the tensor cores
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
            q_base = lax.axis_index("q_tile") * (2 * BLOCK_Q) + wg * BLOCK_Q
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, BLOCK_Q), head], qo_smem, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((BLOCK_Q, D), 0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            pl.when(wg == 1)(take_turn)

            def step(i, carry, masked=False):
                acc, m, l = carry
                slot = lax.rem(i, i32(stages))

                def qk_scope(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:  # the last block: keys at or past the length get no weight
                    cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(cols + i * block_kv < length, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

                def pv_scope(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    nxt = i + 1

                    @pl.when(nxt < steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, i32(stages))])

                acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            full = lax.div(length, i32(block_kv))
            carry = lax.fori_loop(0, full, step, (acc, m, l))
            acc, m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
            pl.when(wg == 0)(take_turn)

            has = l > 0
            acc /= lax.broadcast_in_dim(jnp.where(has, l, 1.0), (BLOCK_Q, D), [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)) * LOG2E, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[bn, pl.ds(q_base, BLOCK_Q), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bn, head, pl.ds(q_base, BLOCK_Q)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _stream():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, i32(G))

            def load(i, slot):
                rows = (b, pl.ds(start + i * block_kv, block_kv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

            for i in range(stages):
                pl.when(i < steps)(functools.partial(load, i, i))

            @pl.loop(0, jnp.maximum(steps - stages, 0))
            def _(i):
                slot = lax.rem(i, i32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                load(i + stages, slot)

    def entry(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref):
        tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((2, BLOCK_Q, D), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_kv, D), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_kv, D), dtype, transforms=tiles),
            plgpu.SMEM((2, BLOCK_Q), jnp.float32),
        )
        pl.run_scoped(
            lambda *scoped: kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((B * splits, Tq, Hq, D), dtype),
            jax.ShapeDtypeStruct((B * splits, Hq, Tq), jnp.float32),
        ),
        grid=(Hq, Tq // (2 * BLOCK_Q), B * splits),
        grid_names=("heads", "q_tile", "chunk"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(kv_len, q, k, v)


@functools.partial(jax.jit, static_argnames=("scale", "splits"))
def prefix_attention(q, k, v, kv_len, *, scale=None, splits: int = 1):
    """Attention of ``q`` over the keys ``[0, kv_len)`` (module docstring: shapes, splits)."""
    _check(q, k, v, kv_len, splits)
    B, Tq, Hq, D = q.shape
    scale = D**-0.5 if scale is None else scale
    pad = -Tq % (2 * BLOCK_Q)
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else q
    out, lse = _partials(qp, k, v, kv_len, float(scale), splits)
    if splits > 1:  # merge the chunks by their log-sum-exp (base 2)
        out = out.reshape(B, splits, Tq + pad, Hq, D)
        lse = jnp.transpose(lse.reshape(B, splits, Hq, Tq + pad), (0, 1, 3, 2))  # [B, n, Tq, Hq]
        out = merge_partials(out, lse, base2=True).astype(q.dtype)
    return out[:, :Tq] if pad else out


CUDA_HEAD_DIM = 64  # jaxkv/cuda/prefix_attention.cu: one 128-byte swizzle row per key


@functools.partial(jax.jit, static_argnames=("scale", "splits"))
def prefix_attention_cuda(q, k, v, kv_len, *, scale=None, splits: int = 1, k_scale=None, v_scale=None):
    """``prefix_attention``'s contract on ``jaxkv/cuda/prefix_attention.cu`` (module docstring); bf16
    and head_dim 64 only; the kernel merges the splits itself. Needs an sm_90 GPU and nvcc
    (the first use builds ``cuda/``). With ``k_scale`` / ``v_scale``: k, v are an FP8 cache's
    codes, read in place."""
    fp8 = k_scale is not None or v_scale is not None
    _check(q, k, v, kv_len, splits, (k_scale, v_scale) if fp8 else None)
    if fp8 and k.shape[1] % 2:
        raise ValueError(f"k: expected an even number of rows for FP8 storage, got {k.shape[1]}")
    if q.dtype != jnp.bfloat16 or q.shape[3] != CUDA_HEAD_DIM:
        raise ValueError(
            f"q: expected bfloat16 with head_dim {CUDA_HEAD_DIM} for the cuda kernel, got {q.dtype} "
            f"with head_dim {q.shape[3]}"
        )
    register_ffi_targets()
    B, Tq, Hq, D = q.shape
    scale = D**-0.5 if scale is None else scale
    # the split partials' workspace (the kernel merges them; a token size for one split)
    part, lse = ((B * splits, Tq, Hq, D), (B * splits, Hq, Tq)) if splits > 1 else ((1, 1, 1, D), (1, 1, 1))
    as_bytes = lambda x: lax.bitcast_convert_type(x, jnp.uint8)  # noqa: E731 - the FFI takes FP8 codes as u8
    kv = (as_bytes(k), as_bytes(v), k_scale, v_scale) if fp8 else (k, v)
    out, _, _ = jax.ffi.ffi_call(
        "jaxkv_prefix_attention_fp8" if fp8 else "jaxkv_prefix_attention",
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(lse, jnp.float32),
        ),
    )(
        q,
        *kv,
        kv_len,
        splits=np.int32(splits),
        scale=np.float32(scale),
        **{name: np.int32(x) for name, x in launch("prefix_attention_cuda").items()},
    )
    return out

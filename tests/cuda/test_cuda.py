"""jaxkv/cuda/flush_write.cu and friends on a GPU: their bytes equal the jnp flush
(jaxkv.hybrid.flush refs) through jax.ffi and through torch. That the sources compile for
sm_90a and sm_100a (CI, no GPU) is checked from an installed wheel: tests/cuda/test_wheel.py."""

from __future__ import annotations

import dataclasses
import functools
import os

import hybrid_driver as D
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import cuda
from jaxkv import hybrid as H
from jaxkv.hybrid import flush as F
from jaxkv.math.compressor import CUR_A, CUR_B, PREV_B


def _divisor_check(*args):
    """Build tests/cuda/div_rn_check.cu with jaxkv.cuda.build and run it: its two lines."""
    import subprocess

    from jaxkv.cuda.build import executable, gencode, nvcc, source_dir

    try:
        nvcc()
    except cuda.BuildError as e:
        pytest.skip(str(e))
    arch = cuda.arch_of(jax.devices()[0].compute_capability)
    src = source_dir()
    exe = executable(
        "tests",
        "div_rn_check",
        [os.path.join(os.path.dirname(__file__), "div_rn_check.cu")],
        ["-O3", *gencode(arch), "-I", str(src)],
        headers=[src / "div_rn.cuh"],
    )
    p = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 2, p.stdout + p.stderr
    for line, name in zip(lines, ("entry", "nvfp4")):
        assert line.startswith(f"{name}: ") and line.endswith(" 0 differ"), line
    return lines


@pytest.mark.gpu
@pytest.mark.exhaustive
def test_shared_divisor_exhaustive():
    """jaxkv/cuda/div_rn.cuh's SharedDivisor equals div.rn.f32 on every quotient the
    per_entry-family flush forms from bf16 inputs (tests/cuda/div_rn_check.cu: 1.1e9 entry
    and 1.3e11 NVFP4 quotients, about a second on an H100), built by jaxkv.cuda.build."""
    _divisor_check()


@pytest.mark.gpu
def test_shared_divisor_sampled():
    """The same check on every 509th divisor: the run compute-sanitizer takes (tools/sanitize.py)."""
    entry, _ = _divisor_check("509")
    assert int(entry.split()[1]) > 1_000_000  # quotients checked


def test_arch_of():
    assert cuda.arch_of("9.0") == "90a" and cuda.arch_of((10, 0)) == "100a" and cuda.arch_of((8, 6)) == "86"


# --- the jnp references ---------------------------------------------------------------------------
def _tails(rng, R, streams, w):
    t = rng.normal(size=(R, streams, 3, w)).astype(np.float32)
    t[:, :, 0][rng.random((R, streams, w)) < 0.1] = -np.inf  # some empty channels
    return jnp.asarray(t)


def test_ref_tail_state(rng):
    R, w = 5, 24
    tails = _tails(rng, R, 3, w)
    slots = jnp.asarray([3, 0, R, -1], jnp.int32)  # R and -1: skipped
    out = np.asarray(F.ref_csa_rotate_state(tails, slots))
    t = np.asarray(tails)
    for s in range(R):
        if s in (3, 0):
            np.testing.assert_array_equal(out[s, PREV_B], t[s, CUR_B])
            for st in (CUR_A, CUR_B):
                assert np.all(out[s, st, 0] == -np.inf) and not out[s, st, 1:].any()
        else:
            np.testing.assert_array_equal(out[s], t[s])
    h = _tails(rng, R, 1, w)
    out = np.asarray(F.ref_hca_reset_state(h, jnp.asarray([2], jnp.int32)))
    assert np.all(out[2, 0, 0] == -np.inf) and not out[2, 0, 1:].any()
    np.testing.assert_array_equal(np.delete(out, 2, 0), np.delete(np.asarray(h), 2, 0))


def test_flush_bad_inputs(rng):
    pool = jnp.zeros((2, 4, 16 * 584), jnp.uint8)
    x = jnp.ones((3, 512), jnp.bfloat16)
    blk = slot = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="layer"):
        F.ref_flush_write(pool, 2, x, blk, slot, storage="official")
    with pytest.raises(ValueError, match="x: expected bf16"):
        F.ref_flush_write(pool, 0, x.astype(jnp.float32), blk, slot, storage="official")
    with pytest.raises(ValueError, match="block"):
        F.ref_flush_write(pool, 0, x, blk[:2], slot, storage="official")
    with pytest.raises(ValueError, match="pool"):
        F.ref_flush_write(pool, 0, x, blk, slot, storage="per_entry")  # 584 is not a multiple of 580
    with pytest.raises(ValueError, match="index_pool, xi"):
        F.ref_flush_write(pool, 0, x, blk, slot, storage="official", xi=jnp.ones((3, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="tails"):
        F.ref_csa_rotate_state(_tails(rng, 2, 1, 8), slot)
    with pytest.raises(ValueError, match="impl"):
        F.check_impl("triton")


# --- on the GPU: kernel == reference, bit for bit ---------------------------------------------------
def _flush_case(rng, storage, csa, L=2, NB=40, bs=16, N=300):
    fmt = H.STORAGES[storage]
    x = rng.normal(size=(N, 512)) * 10.0 ** rng.uniform(-3, 2, size=(N, 1))
    x[0, :64] = 0  # an all-zero tile (clamped scale)
    x[1, 64:128] *= 1e-7  # a tile below the 1e-4 clamp
    x[2, :448] *= 1e4  # saturating magnitudes
    x[3, 100] = np.inf
    x[4, 5] = np.nan
    x[8] *= 1e-37  # scales below 2^-32 and f32-subnormal ones (bf16 keeps magnitudes to ~1e-40)
    x[9] *= 1e-40
    x[9, 10] = -0.0
    xi = rng.normal(size=(N, 128)) * 10.0 ** rng.uniform(-3, 2, size=(N, 1))
    xi[5, :32] = 0
    xi[6, 40] = np.nan
    xi[7] *= 1e-38
    # distinct (block, slot) per row; some rows go nowhere (block -1 or NB)
    cells = rng.permutation(NB * bs)[:N]
    block, slot = (cells // bs).astype(np.int32), (cells % bs).astype(np.int32)
    block[rng.random(N) < 0.1] = -1
    block[7] = NB
    pool = jnp.asarray(rng.integers(0, 256, size=(L, NB, bs * fmt.entry_bytes), dtype=np.uint8))
    args = dict(x=jnp.asarray(x, jnp.bfloat16), block=jnp.asarray(block), slot=jnp.asarray(slot))
    if csa:
        kb = fmt.index_key_bytes(128)
        args.update(
            index_pool=jnp.asarray(rng.integers(0, 256, size=(L, NB, bs * kb), dtype=np.uint8)),
            xi=jnp.asarray(xi, jnp.bfloat16),
        )
    return pool, args


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
def test_flush_write_cuda_equals_jnp(rng, storage, csa):
    pool, args = _flush_case(rng, storage, csa)
    want = jax.jit(functools.partial(F.ref_flush_write, layer=1, storage=storage))(pool, **args)
    kernel = jax.jit(functools.partial(F.flush_write_cuda, layer=1, storage=storage), donate_argnums=0)
    got = kernel(jnp.array(pool), **{k: (jnp.array(v) if k == "index_pool" else v) for k, v in args.items()})
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert not np.array_equal(np.asarray(jax.tree_util.tree_leaves(want)[0]), np.asarray(pool))  # it wrote


def test_encode_rows_reference_and_bad_inputs(rng):
    """ref_encode_rows: each row's codec bytes at (i // bs, i % bs), the spare items zero; the
    kernel's validators."""
    from jaxkv.formats.storage import STORAGES, read_items
    from jaxkv.kernels import encode_rows, ref_encode_rows

    x = jnp.asarray(rng.normal(size=(37, 512)), jnp.bfloat16)
    for storage in STORAGES:
        codec = STORAGES[storage].entry
        pool = ref_encode_rows(x, 32, storage=storage)
        assert pool.shape == (2, 32 * sum(codec.segments))
        i = jnp.arange(40)
        items = np.asarray(read_items(pool[None], 0, i // 32, i % 32, codec.segments))
        np.testing.assert_array_equal(items[:37], np.asarray(codec.encode(x)))
        assert not items[37:].any() and items[:37].any()
    with pytest.raises(ValueError, match=r"x: expected bf16\[\.\.\., 512\]"):
        encode_rows(x.astype(jnp.float32), 32, storage="official")
    with pytest.raises(ValueError, match="at least one row"):
        encode_rows(x[:0], 32, storage="official")
    with pytest.raises(ValueError, match="block_size: expected at least 1"):
        encode_rows(x, 0, storage="official")
    with pytest.raises(ValueError, match="storage"):
        encode_rows(x, 32, storage="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("n", [1, 37, 64])
def test_encode_rows_cuda_equals_jnp(rng, storage, n):
    """The kernel's bytes are the reference's at every magnitude, NaN / Inf rows and the
    zero spare items of a last partial block included."""
    from jaxkv.kernels import encode_rows, ref_encode_rows
    from jaxkv.stacked import Stacked

    x = rng.normal(size=(n, 512)) * rng.choice([1e-6, 1e-2, 1.0, 300.0, 1e5], size=(n, 1))
    if n > 2:
        x[1, 5] = np.nan
        x[2, 500] = np.inf
    x = jnp.asarray(x, jnp.bfloat16)
    got = np.asarray(encode_rows(x, 32, storage=storage))
    np.testing.assert_array_equal(got, np.asarray(ref_encode_rows(x, 32, storage=storage)))
    assert got.any()
    # a Stacked row of bf16[3, n, 1, 512] is read in place: the middle one's bytes
    stack = jnp.stack([jnp.flip(x, 0), x, -x])[:, :, None]
    got = np.asarray(encode_rows(Stacked(stack, 1), 32, storage=storage))
    np.testing.assert_array_equal(got, np.asarray(ref_encode_rows(x, 32, storage=storage)))


@pytest.mark.gpu
def test_cuda_tail_state_equals_jnp(rng):
    R = 64
    slots = jnp.asarray(np.concatenate([rng.permutation(R)[:20], [R, -3]]).astype(np.int32))
    for streams, w, ref, kern in (
        (3, 640, F.ref_csa_rotate_state, F.csa_rotate_state_cuda),
        (1, 512, F.ref_hca_reset_state, F.hca_reset_state_cuda),
    ):
        tails = _tails(rng, R, streams, w)
        want = jax.jit(ref)(tails, slots)
        got = jax.jit(kern, donate_argnums=0)(jnp.array(tails), slots)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_compress_cuda_equals_xla(rng, storage):
    """A prefill chunk then decode steps, rows at different positions: same cache bytes."""
    c = dataclasses.replace(
        H.HybridConfig(
            compress_ratios=(4, 128),
            window=32,
            index_heads=4,
            top_k=16,
            block_size=16,
            max_requests=3,
            max_context=1024,
        ),
        storage=storage,
    )
    params = D.make_params(c, rng)
    B = 3
    pre = D.make_inputs(c, rng, B, 300)
    states = {}
    for impl in ("xla", "cuda"):
        st = H.init(c)
        lens = np.array([300, 131, 257])
        st, step = H.prepare_forward(st, jnp.arange(B), jnp.zeros(B, jnp.int32), jnp.asarray(lens), chunk=300)
        st = D.compress_all(st, step, pre, params, impl)
        pos = lens.copy()
        for t in range(12):
            st, step = H.prepare_forward(st, jnp.arange(B), jnp.asarray(pos), chunk=1)
            st = D.compress_all(st, step, D.slice_tokens(pre, t, t + 1), params, impl)
            pos += 1
        states[impl] = st
    for a, b in zip(jax.tree_util.tree_leaves(states["xla"]), jax.tree_util.tree_leaves(states["cuda"])):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


# --- the same kernels from torch, on views of jax buffers ----------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_torch_flush_write_on_jax_buffers(rng, storage):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from torch_bridge import kernels as K
    from torch_bridge import to_torch

    pool, args = _flush_case(rng, storage, True)
    want_pool, want_index = jax.jit(functools.partial(F.ref_flush_write, layer=1, storage=storage))(pool, **args)
    jpool, jindex = jnp.array(pool), jnp.array(args["index_pool"])
    tp, ti = to_torch(jpool), to_torch(jindex)
    K.flush_write(
        tp[1],
        to_torch(args["x"]),
        to_torch(args["block"]),
        to_torch(args["slot"]),
        storage=storage,
        index_pool=ti[1],
        xi=to_torch(args["xi"]),
    )
    torch.cuda.synchronize()
    np.testing.assert_array_equal(np.asarray(jpool), np.asarray(want_pool))  # the jax arrays see torch's writes
    np.testing.assert_array_equal(np.asarray(jindex), np.asarray(want_index))
    tails = _tails(rng, 8, 3, 640)
    slots = jnp.asarray([5, 1], jnp.int32)
    want = F.ref_csa_rotate_state(tails, slots)
    jt = jnp.array(tails)
    K.csa_rotate_state(to_torch(jt), to_torch(slots))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(np.asarray(jt), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, dim", [("bfloat16", 16, 64), ("float16", 1, 6), ("float32", 3, 5)])
@pytest.mark.parametrize("poison", [None, "nan", "+inf", "-inf"])
def test_torch_frame_append_equals_torch_ops(dtype, heads, dim, poison):
    """jaxkv/cuda/frame_append.cu: a clean frame lands at its rows, every other row untouched; a
    frame with one NaN / Inf anywhere (here the last element of V, or a random element of
    K) lands wholly at the trash row, the rows keep what they held, the sticky flag is set.
    Row sizes 2048 B (16-byte copies), 12 B and 60 B (4-byte copies)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from torch_bridge import kernels as K

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    n, T, trash = 37, 300, 299
    k, v = (torch.randn(n, heads, dim, generator=g).to(dt).cuda() for _ in range(2))
    kbuf, vbuf = (torch.randn(T, heads, dim, generator=g).to(dt).cuda() for _ in range(2))
    rows = torch.randperm(T - 1, generator=g)[:n].cuda()
    if poison:
        value = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}[poison]
        if poison == "nan":
            k.view(-1)[int(torch.randint(k.numel(), (1,), generator=g))] = value
        else:
            v.view(-1)[-1] = value
    want_k, want_v = kbuf.clone(), vbuf.clone()
    if not poison:  # (poisoned, every row writes the trash row: its content is any of them)
        want_k[rows], want_v[rows] = k, v
    sticky = torch.zeros((), dtype=torch.bool, device="cuda")
    scratch = torch.full((K.APPEND_SCRATCH,), 7, dtype=torch.int32, device="cuda")
    K.frame_append(k, v, kbuf, vbuf, rows, trash, scratch, sticky)
    torch.cuda.synchronize()
    assert bool(sticky) == bool(poison)
    keep = torch.ones(T, dtype=torch.bool, device="cuda")
    keep[trash] = not poison
    assert torch.equal(kbuf[keep], want_k[keep]) and torch.equal(vbuf[keep], want_v[keep])
    with pytest.raises(ValueError, match="rows, scratch, sticky"):
        K.frame_append(k, v, kbuf, vbuf, rows.int(), trash, scratch, sticky)

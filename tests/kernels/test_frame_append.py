"""kernels.frame_append (Mosaic GPU) against its jnp reference natively on a GPU; its validators and
the refusal off Hopper everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_GPU

from jaxkv.formats.fp8 import quantize_fp8_rows
from jaxkv.kernels import ref_write_frame, ref_write_frame_fp8, write_frame, write_frame_fp8


def _frame_case(rng, L, B, NS, P, HD, T, dtype=jnp.bfloat16):
    bufs = [[jnp.asarray(rng.normal(size=(B, T, HD)), dtype) for _ in range(L)] for _ in range(2)]
    k, v = (jnp.asarray(rng.normal(size=(L, B, NS + P, HD)), dtype) for _ in range(2))
    special_row = jnp.asarray(rng.integers(T // 2, T - NS, size=B), jnp.int32)  # runs never overlap
    return bufs, k, v, special_row


@pytest.mark.gpu
@pytest.mark.parametrize("L,B,NS,P,page", [(2, 1, 6, 37, 37), (3, 2, 6, 20, 32), (1, 2, 0, 16, 16), (2, 1, 17, 5, 8)])
def test_frame_append_matches_reference(rng, L, B, NS, P, page):
    T, HD = 160, 64
    (kb, vb), k, v, sr = _frame_case(rng, L, B, NS, P, HD, T)
    pr = jnp.asarray(rng.integers(0, T // 2 - page, size=B), jnp.int32)
    kw = dict(num_special=NS, page_size=page)
    want = jax.device_get(ref_write_frame(kb, vb, k, v, sr, pr, **kw))
    got = write_frame([x.copy() for x in kb], [x.copy() for x in vb], k, v, sr, pr, **kw)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the reference itself: rows outside the two runs untouched, page padding zero
    for l in range(L):
        for b in range(B):
            out = np.asarray(want[0][l][b], np.float32)
            np.testing.assert_array_equal(out[int(sr[b]) : int(sr[b]) + NS], np.asarray(k[l, b, :NS], np.float32))
            np.testing.assert_array_equal(out[int(pr[b]) : int(pr[b]) + P], np.asarray(k[l, b, NS:], np.float32))
            assert not out[int(pr[b]) + P : int(pr[b]) + page].any()


def test_frame_append_bad_inputs(rng):
    (kb, vb), k, v, sr = _frame_case(rng, 2, 1, 6, 10, 64, 64)
    with pytest.raises(ValueError, match="v: expected"):
        write_frame(kb, vb, k, v[:, :, :5], sr, sr, num_special=6, page_size=10)
    with pytest.raises(ValueError, match="k_bufs, v_bufs: expected 2 buffers"):
        write_frame(kb[:1], vb, k, v, sr, sr, num_special=6, page_size=10)
    with pytest.raises(ValueError, match="patch_row: expected int32"):
        write_frame(
            kb, vb, k, v, sr, sr.astype(jnp.int64 if jax.config.x64_enabled else jnp.int16), num_special=6, page_size=10
        )
    with pytest.raises(ValueError, match="page_size"):
        write_frame(kb, vb, k, v, sr, sr, num_special=6, page_size=9)


@pytest.mark.gpu
def test_frame_append_native_lingbot_shape(rng):
    (kb, vb), k, v, sr = _frame_case(rng, 24, 1, 6, 999, 1024, 8_192)
    pr = jnp.asarray([999 * 3], jnp.int32)
    kw = dict(num_special=6, page_size=999)
    want = jax.device_get(ref_write_frame(kb, vb, k, v, sr, pr, **kw))
    got = write_frame(kb, vb, k, v, sr, pr, **kw)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_frame_append_impls_agree(rng, pow2):
    """frame.append with the Pallas writer equals the XLA writer through fills, evictions, rollbacks."""
    from jaxkv import frame

    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=2,
        head_dim=16,
        patches_per_frame=12,
        num_special=3,
        scale_frames=1,
        sliding_window=2,
        max_frames=16,
        num_streams=2,
        pow2_pages=pow2,
    )
    states = {impl: frame.init(spec) for impl in ("xla", "pallas")}
    for t in range(6):
        k, v = (jnp.asarray(rng.normal(size=(2, 2, spec.tokens_per_frame, 2, 16)), jnp.bfloat16) for _ in range(2))
        keep = jnp.asarray([t % 3 != 2, True])
        for impl in states:
            states[impl] = frame.resolve(frame.append(states[impl], k, v, defer=True, impl=impl), keep)
    a, b = (jax.device_get(states[i]) for i in ("xla", "pallas"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="impl: expected one of"):
        frame.append(states["xla"], k, v, impl="triton")
    with pytest.raises(ValueError, match="impl='cuda' for frame.append: expected an FP8 cache"):
        frame.append(states["xla"], k, v, impl="cuda")


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal off a Hopper GPU")
def test_frame_append_kernel_needs_hopper(rng):
    """Off Hopper, impl="pallas" is a ValueError that says why, "auto" is xla, and the cache is untouched."""
    from jaxkv import frame

    assert frame.ops.default_append_impl() == "xla"
    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=2,
        head_dim=16,
        patches_per_frame=4,
        num_special=1,
        scale_frames=1,
        sliding_window=2,
        max_frames=8,
    )
    st = frame.init(spec)
    k, v = (jnp.asarray(rng.normal(size=(2, 1, spec.tokens_per_frame, 2, 16)), jnp.bfloat16) for _ in range(2))
    with pytest.raises(ValueError, match="impl='pallas' for frame.append: expected an NVIDIA Hopper GPU"):
        frame.append(st, k, v, impl="pallas")
    assert not np.asarray(frame.num_frames(st)).any()  # one count per stream


# ---------------------------------------------------------------- an FP8 cache
def _fp8_case(rng, L, B, NS, P, H, T):
    """Buffers holding old codes and scales, and a frame whose rows span magnitudes, with an
    all-zero row, negative zeros and exact E4M3 ties (a row of amax 448 has scale 1: 17 lies
    between the codes 16 and 18)."""
    codes = [jnp.asarray(rng.normal(size=(B, T, H, 64)), jnp.float8_e4m3fn) for _ in range(2 * L)]
    scales = [jnp.asarray(rng.random(size=(B, T, H)) + 0.1, jnp.bfloat16) for _ in range(2 * L)]
    gain = np.exp(rng.uniform(-12, 12, size=(L, B, NS + P, H, 1)))
    k, v = (rng.normal(size=(L, B, NS + P, H, 64)) * gain for _ in range(2))
    k[0, 0, 0, 0] = 0.0
    k[0, 0, 0, min(1, H - 1), :8] = -0.0
    k[0, 0, -1, 0] = np.where(np.arange(64) % 2, 17.0, -448.0)
    special_row = jnp.asarray(rng.integers(T // 2, T - NS, size=B), jnp.int32)
    return codes, scales, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), special_row


def _bytes(x):
    return np.asarray(x).view(np.uint8)


def test_fp8_reference_places_quantized_rows(rng):
    """ref_write_frame_fp8: each stream's specials and patches at their rows, as
    quantize_fp8_rows encodes them; padding rows zero codes and scales; other rows untouched."""
    L, B, NS, P, page, H, T = 2, 2, 3, 7, 8, 2, 48
    codes, scales, k, v, sr = _fp8_case(rng, L, B, NS, P, H, T)
    pr = jnp.asarray([0, 16], jnp.int32)
    got_codes, got_scales = ref_write_frame_fp8(codes, scales, k, v, sr, pr, num_special=NS, page_size=page)
    (kq, ks), (vq, vs) = quantize_fp8_rows(k), quantize_fp8_rows(v)
    for i in range(2 * L):
        q, sc = (kq, ks) if i < L else (vq, vs)
        l = i % L
        for b in range(B):
            want_c, want_s = _bytes(codes[i][b]).copy(), _bytes(scales[i][b]).copy()
            s0, p0 = int(sr[b]), int(pr[b])
            want_c[s0 : s0 + NS], want_s[s0 : s0 + NS] = _bytes(q[l, b, :NS]), _bytes(sc[l, b, :NS])
            want_c[p0 : p0 + P], want_s[p0 : p0 + P] = _bytes(q[l, b, NS:]), _bytes(sc[l, b, NS:])
            want_c[p0 + P : p0 + page], want_s[p0 + P : p0 + page] = 0, 0
            np.testing.assert_array_equal(_bytes(got_codes[i][b]), want_c)
            np.testing.assert_array_equal(_bytes(got_scales[i][b]), want_s)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "L,B,NS,P,page,H", [(2, 1, 6, 37, 37, 2), (3, 2, 6, 20, 32, 3), (1, 2, 0, 16, 16, 1), (33, 1, 2, 5, 8, 2)]
)
def test_fp8_kernel_matches_reference(rng, L, B, NS, P, page, H):
    """Bit for bit, codes and scales, past one launch's 32 layers."""
    T = 96
    codes, scales, k, v, sr = _fp8_case(rng, L, B, NS, P, H, T)
    pr = jnp.asarray(rng.integers(0, T // 2 - page, size=B), jnp.int32)
    kw = dict(num_special=NS, page_size=page)
    want = jax.device_get(ref_write_frame_fp8(codes, scales, k, v, sr, pr, **kw))
    got = write_frame_fp8([x.copy() for x in codes], [x.copy() for x in scales], k, v, sr, pr, **kw)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))


@pytest.mark.gpu
def test_fp8_kernel_native_lingbot_shape(rng):
    codes, scales, k, v, sr = _fp8_case(rng, 24, 1, 6, 999, 16, 2_048)
    pr = jnp.asarray([999], jnp.int32)
    kw = dict(num_special=6, page_size=999)
    want = jax.device_get(ref_write_frame_fp8(codes, scales, k, v, sr, pr, **kw))
    got = write_frame_fp8(codes, scales, k, v, sr, pr, **kw)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))


@pytest.mark.gpu
def test_fp8_append_impls_agree(rng):
    """An FP8 cache through fills, evictions and rollbacks: append with the cuda writer (and
    write_layer per layer, whose auto is the kernel) equals append with XLA's, bit for bit."""
    from jaxkv import frame

    spec = frame.FrameSpec(
        num_layers=3, num_heads=2, head_dim=64, patches_per_frame=12, num_special=3, scale_frames=1,
        sliding_window=2, max_frames=16, num_streams=2, dtype="float8_e4m3fn",
    )  # fmt: skip
    assert frame.ops.default_append_impl(spec.dtype, spec.head_dim) == "cuda"
    names = ("xla", "cuda", "layers")
    states = {name: frame.init(spec) for name in names}
    for t in range(7):
        k, v = (jnp.asarray(rng.normal(size=(3, 2, spec.tokens_per_frame, 2, 64)), jnp.bfloat16) for _ in range(2))
        keep = jnp.asarray([t % 3 != 2, True])
        for name in ("xla", "cuda"):
            states[name] = frame.resolve(frame.append(states[name], k, v, defer=True, impl=name), keep)
        st = frame.begin_frame(states["layers"], defer=True)
        for layer in range(3):
            st = frame.write_layer(st, layer, k[layer], v[layer])
        states["layers"] = frame.resolve(st, keep)
    a = jax.device_get(states["xla"])
    for name in names[1:]:
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(jax.device_get(states[name])), strict=True):
            np.testing.assert_array_equal(_bytes(x), _bytes(y), err_msg=name)


def test_fp8_kernel_bad_inputs(rng):
    codes, scales, k, v, sr = _fp8_case(rng, 2, 1, 3, 5, 2, 32)
    kw = dict(num_special=3, page_size=5)
    with pytest.raises(ValueError, match="k, v: expected bfloat16"):
        write_frame_fp8(codes, scales, k.astype(jnp.float32), v, sr, sr, **kw)
    with pytest.raises(ValueError, match="codes: expected 4 buffers"):
        write_frame_fp8(codes[:3], scales, k, v, sr, sr, **kw)
    with pytest.raises(ValueError, match=r"scales\[1\]: expected bfloat16"):
        write_frame_fp8(codes, [scales[0], scales[1].astype(jnp.float32), *scales[2:]], k, v, sr, sr, **kw)
    with pytest.raises(ValueError, match="page_size"):
        write_frame_fp8(codes, scales, k, v, sr, sr, num_special=3, page_size=4)

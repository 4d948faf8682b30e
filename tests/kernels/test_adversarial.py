"""Hostile tables, indices and lengths fed to every kernel, on the GPU.

What a buggy or hostile caller could pass: block, row and page ids outside their pools (the
int32 extremes included), a count or length past capacity or negative, ids past a count that
name rows another request owns, window slots that are not a request's, NaN / Inf data, empty
requests. Each row is refused (``ValueError`` at trace time), masked by design, or a sticky
fault; the rule of each kernel is in docs/reliability.md. Two properties are checked for
every row, not only the output against the reference:

* no byte a request may not read reaches its output: the output is bit-identical after every
  such byte is replaced, by random bytes and then by 0xFF (NaN in every float format here);
* no byte outside what the request may write changes.

The jnp references take the attention and scoring rows too (``reference``: everywhere, CI
included). ``tools/sanitize.py`` runs this file (and every GPU kernel test) under compute-sanitizer,
which shows that no access leaves its allocation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv._backend import _flashmla_missing, _pool_cuda_missing, _prefix_cuda_missing, is_hopper
from jaxkv.formats.storage import STORAGES, pack_items

I32_MIN, I32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max
gpu = pytest.mark.gpu
hopper = pytest.mark.skipif(not is_hopper(), reason="Mosaic GPU kernels for Hopper (sm_90); no GPU here")


def _others(rng, x, keep):
    """x with every byte outside ``keep`` (bool, x's shape) replaced: random, then 0xFF."""
    x = np.asarray(x)
    u8 = x.view(np.uint8).reshape(*x.shape, -1)
    keep = np.broadcast_to(np.asarray(keep)[..., None], u8.shape)
    out = []
    for fill in (rng.integers(0, 256, size=u8.shape, dtype=np.uint8), np.full(u8.shape, 0xFF, np.uint8)):
        out.append(jnp.asarray(np.where(keep, u8, fill).view(x.dtype).reshape(x.shape)))
    return out


def _same(a, b, what):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


def _row_bytes(keep_rows, bs, segments):
    """bool[blocks, bs * E]: the bytes of the rows ``keep_rows`` (bool[blocks * bs]) in a
    segment-major block (each segment's ``bs`` items, then the next segment's)."""
    keep = np.asarray(keep_rows).reshape(-1, bs)
    return np.concatenate([np.repeat(keep, z, axis=1) for z in segments], axis=1)


def _entries(rng, storage, rows, bs):
    """u8[rows // bs, bs * E]: every slot a random entry encoded by the storage's codec."""
    codec = STORAGES[storage].entry
    x = jnp.asarray(rng.normal(size=(rows, 512)) * rng.uniform(0.1, 4, size=(rows, 1)), jnp.bfloat16)
    return np.asarray(jax.jit(lambda x: pack_items(codec.encode(x), bs, codec.segments))(x))


# --- dequant_gather: block ids outside the pool give zero rows; slots clamp within the block ---
@gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_dequant_gather(rng, storage):
    from jaxkv.kernels import dequant_gather, ref_dequant_gather

    L, NB, bs = 3, 6, 16
    pool = np.stack([_entries(rng, storage, NB * bs, bs) for _ in range(L)])
    block = np.array([0, 5, -1, -2, NB, NB + 7, I32_MIN, I32_MAX, 3, 3, 3], np.int32)
    slot = np.array([0, 15, 0, 0, 0, 0, 0, 0, -1, bs, I32_MAX], np.int32)
    run = lambda p: dequant_gather(p, 1, jnp.asarray(block), jnp.asarray(slot), storage=storage)  # noqa: E731
    got = run(jnp.asarray(pool))
    _same(got, ref_dequant_gather(jnp.asarray(pool), 1, jnp.asarray(block), jnp.asarray(slot), storage), "reference")
    g = np.asarray(got, np.float32)
    assert not g[2:8].any() and g[[0, 1, 8]].any()
    keep = np.zeros(pool.shape[:2], bool)
    keep[1, [0, 3, 5]] = True  # the blocks named in range, in layer 1
    for other in _others(rng, pool, keep[..., None]):
        _same(run(other), got, "a byte outside the named blocks reached the output")


# --- pool attention: ids outside the pool and rows past a count are masked ---------------------
def _pool_case(rng, storage):
    """Two parts (entries: 6 blocks of 64 slots; a ring: 4 of 32), 4 query rows of 64 heads:
    row 0 mixes hostile ids into its counted rows, row 1 has counts < 0 and > 64, row 2 is
    empty, row 3 plain. Every id past a count names a row no query may read."""
    bs = (64, 32)
    pools = [_entries(rng, storage, 6 * 64, 64), _entries(rng, storage, 4 * 32, 32)]
    size = [p.shape[0] * b for p, b in zip(pools, bs)]
    part_blocks = (2, 1)
    N, H = 4, 64
    own = [rng.permutation(size[p])[: size[p] // 2] for p in range(2)]  # rows any query may read
    banned = [np.setdiff1d(np.arange(size[p]), own[p]) for p in range(2)]
    rows = np.concatenate(
        [rng.choice(banned[p], size=(N, k * 64)) for p, k in zip(range(2), part_blocks)], axis=1
    ).astype(np.int32)
    nvalid = np.zeros((N, 3), np.int32)
    for n, counts in ((0, (64, 40, 20)), (1, (-5, 1000, 17)), (3, (64, 1, 32))):
        for b, c in enumerate(counts):
            p = 0 if b < 2 else 1
            k = int(np.clip(c, 0, 64))
            rows[n, b * 64 : b * 64 + k] = rng.choice(own[p], size=k)
        nvalid[n] = counts
    hostile = [-2, I32_MIN, I32_MAX, size[0], size[0] + 7, -1]
    rows[0, [3, 9, 70, 80, 100, 130]] = hostile  # inside block 0's, 1's and 2's counts
    q = jnp.asarray(rng.normal(size=(N, H, 512)), jnp.bfloat16)
    sink = jnp.asarray(rng.normal(size=(H,)), jnp.float32)
    keep = [np.zeros(s, bool) for s in size]
    for p in range(2):
        keep[p][own[p]] = True
    return q, pools, part_blocks, rows, nvalid, sink, keep, bs


def _ref_pool(*args, splits=1, **kw):
    from jaxkv.kernels import ref_pool_attention

    return ref_pool_attention(*args, **kw).astype(jnp.bfloat16)


def _pool_kernels():
    from jaxkv.kernels import pool_attention_cuda, pool_attention_flashmla, pool_attention_pallas

    cuda_missing, mla_missing = _pool_cuda_missing(), _flashmla_missing(block_size=32, window=32)
    return [
        pytest.param(
            pool_attention_cuda,
            "official",
            marks=[gpu, pytest.mark.skipif(bool(cuda_missing), reason=f"{cuda_missing}")],
            id="cuda-official",
        ),
        pytest.param(
            pool_attention_cuda,
            "per_entry",
            marks=[gpu, pytest.mark.skipif(bool(cuda_missing), reason=f"{cuda_missing}")],
            id="cuda-per_entry",
        ),
        pytest.param(pool_attention_pallas, "official", marks=[gpu, hopper], id="pallas"),
        pytest.param(
            pool_attention_flashmla,
            "official",
            marks=[gpu, pytest.mark.skipif(bool(mla_missing), reason=f"FlashMLA: {mla_missing}")],
            id="flashmla",
        ),
        pytest.param(_ref_pool, "official", id="reference-official"),
        pytest.param(_ref_pool, "per_entry", id="reference-per_entry"),
    ]


@pytest.mark.parametrize("kernel,storage", _pool_kernels())
def test_pool_attention(rng, kernel, storage):
    from jaxkv.kernels import ref_pool_attention

    q, pools, pb, rows, nvalid, sink, keep, bs = _pool_case(rng, storage)
    rows_j, nvalid_j = jnp.asarray(rows), jnp.asarray(nvalid)
    run = lambda ps: kernel(q, tuple(ps), pb, rows_j, nvalid_j, sink, storage=storage)  # noqa: E731
    got = run([jnp.asarray(p) for p in pools])
    ref = ref_pool_attention(q, tuple(jnp.asarray(p) for p in pools), pb, rows_j, nvalid_j, sink, storage=storage)
    g, r = np.asarray(got, np.float32), np.asarray(ref)
    assert np.isfinite(g).all() and not g[2].any(), "row 2 has no valid key: zeros"
    assert np.abs(g - r).max() <= 2e-2 * np.abs(r).max() + 1e-3, np.abs(g - r).max()
    # the bytes of the rows no query may read, replaced: the same output bit for bit
    segments = STORAGES[storage].entry.segments
    variants = [_others(rng, p, _row_bytes(k, b, segments)) for p, b, k in zip(pools, bs, keep)]
    for i in range(2):
        _same(run([v[i] for v in variants]), got, "a row past a count, or outside the pool, reached the output")


# --- index scores: pages outside the pool score -inf, counts clamp --------------------------------
@pytest.mark.parametrize(
    "impl", [pytest.param("pallas", marks=[gpu, hopper]), pytest.param("cuda", marks=[gpu, hopper]), "reference"]
)
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_index_scores(rng, storage, impl):
    from jaxkv.kernels.index_scores import index_scores, index_scores_cuda, ref_index_scores

    index_scores = {"pallas": index_scores, "cuda": index_scores_cuda, "reference": ref_index_scores}[impl]

    codec = STORAGES[storage].index_key(128)
    L, P, bs, NP = 2, 12, 64, 3
    x = rng.normal(size=(L * P * bs, 128))
    pool = np.asarray(jax.jit(lambda x: pack_items(codec.encode(x), bs, codec.segments))(jnp.asarray(x, jnp.float32)))
    pool = pool.reshape(L, P, -1)
    perm = rng.permutation(P)
    pages = np.array([[perm[0], -3, P + 2], [perm[1], perm[2], I32_MAX], [perm[3], perm[4], perm[5]]], np.int32)
    count = np.array([NP * bs, NP * bs + 500, -4], np.int32)  # row 2 sees nothing: its pages are banned
    q = jnp.asarray(rng.normal(size=(3, 64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    args = (jnp.asarray(pages), jnp.asarray(count))
    run = lambda p: index_scores(q, w, p, 1, *args, storage=storage)  # noqa: E731
    got = np.asarray(run(jnp.asarray(pool)))
    want = np.asarray(ref_index_scores(q, w, jnp.asarray(pool), 1, *args, storage=storage))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isneginf(got[0, bs:]).all() and np.isneginf(got[1, 2 * bs :]).all() and np.isneginf(got[2]).all()
    fin = np.isfinite(want)
    assert fin.sum() == 3 * bs
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5 * np.abs(want[fin]).max())
    keep = np.zeros((L, P), bool)
    keep[1, perm[:3]] = True  # the pages counted and in range, layer 1
    for other in _others(rng, pool, keep[..., None]):
        _same(run(other), got, "a page outside the counted ones reached the scores")


# --- prefix attention: lengths clamp to [0, T]; keys past the length never reach the output -----
def _ref_prefix(q, k, v, kv_len, *, splits=1):
    from jaxkv.kernels import ref_prefix_attention

    return ref_prefix_attention(q, k, v, kv_len).astype(q.dtype)


def _prefix_kernels():
    from jaxkv.kernels import prefix_attention, prefix_attention_cuda

    missing = _prefix_cuda_missing()
    return [
        pytest.param(prefix_attention, marks=[gpu, hopper], id="pallas"),
        pytest.param(
            prefix_attention_cuda, marks=[gpu, pytest.mark.skipif(bool(missing), reason=f"{missing}")], id="cuda"
        ),
        pytest.param(_ref_prefix, id="reference"),
    ]


@pytest.mark.parametrize("kernel", _prefix_kernels())
@pytest.mark.parametrize("splits", [1, 2])
def test_prefix_attention(rng, kernel, splits):
    from jaxkv.kernels import prefix_attention, ref_prefix_attention
    from jaxkv.kernels.prefix_attention import _block_kv

    T, H, D = 512, 2, 64
    kv_len = np.array([T + 100, I32_MIN, I32_MAX, 200, 0, -5, 30, 320], np.int32)
    B = len(kv_len)
    q = jnp.asarray(rng.normal(size=(B, 8, 2 * H, D)), jnp.bfloat16)
    k, v = (np.asarray(jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.bfloat16)) for _ in range(2))
    run = lambda k, v: kernel(q, k, v, jnp.asarray(kv_len), splits=splits)  # noqa: E731
    got = run(jnp.asarray(k), jnp.asarray(v))
    want = ref_prefix_attention(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_len))
    g = np.asarray(got, np.float32)
    assert not g[[1, 4, 5]].any() and np.isfinite(g).all()
    np.testing.assert_allclose(g, np.asarray(want), atol=2e-2)
    seen = np.clip(kv_len, 0, T)
    if kernel is prefix_attention:  # Mosaic GPU: the last key block is read whole (its docstring)
        bk = _block_kv(T // splits)
        seen = np.minimum(-(-seen // bk) * bk, T)
    keep = np.arange(T)[None, :] < seen[:, None]  # [B, T]: the rows the entry may read
    ok, ov = _others(rng, k, keep[..., None, None]), _others(rng, v, keep[..., None, None])
    for i in range(2):
        _same(run(ok[i], ov[i]), got, "a key or value past the length reached the output")


# --- frame append: destination rows clamp as dynamic_update_slice clamps --------------------------
@gpu
@hopper
def test_frame_append(rng):
    from jaxkv.kernels import ref_write_frame, write_frame

    L, B, T, NS, P, page = 2, 4, 96, 3, 13, 16
    hd = 128
    bufs = lambda: tuple(jnp.asarray(rng.normal(size=(B, T, hd)), jnp.bfloat16) for _ in range(L))  # noqa: E731
    kb, vb = bufs(), bufs()
    k, v = (jnp.asarray(rng.normal(size=(L, B, NS + P, hd)), jnp.bfloat16) for _ in range(2))
    # clamped: stream 0 to rows 0 and 80, 1 to 93 and 0, 2 to 93 and 0 (no two writes overlap:
    # the kernel's writes run in parallel, the reference's in order)
    special = jnp.asarray([-7, I32_MAX, T - 2, 5], jnp.int32)
    patch = jnp.asarray([I32_MAX, -1, I32_MIN, 40], jnp.int32)
    kw = dict(num_special=NS, page_size=page)
    want = jax.device_get(ref_write_frame(kb, vb, k, v, special, patch, **kw))  # done before any donation
    host = [np.asarray(b) for b in kb + vb]
    got = write_frame([x.copy() for x in kb], [x.copy() for x in vb], k, v, special, patch, **kw)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        _same(g, w, "frame append")
    for g, h in zip(jax.tree_util.tree_leaves(got), host):  # stream 3 (in range) wrote rows 5.. and 40..
        changed = np.flatnonzero((np.asarray(g)[3] != h[3]).any(-1))
        assert set(changed) <= set(range(5, 5 + NS)) | set(range(40, 40 + page)), changed


def test_frame_rows_clip_to_the_buffer(rng):
    """The reference (the XLA path) clips as the kernel does: a negative row is row 0, not a row
    counted from the buffer's end."""
    from jaxkv.kernels import ref_write_frame

    B, T, NS, P, page, hd = 3, 40, 2, 6, 8, 16
    kb, vb = ((jnp.asarray(rng.normal(size=(B, T, hd)), jnp.float32),) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(1, B, NS + P, hd)), jnp.float32) for _ in range(2))
    special = jnp.asarray([-1, I32_MAX, I32_MIN], jnp.int32)
    patch = jnp.asarray([I32_MAX, -3, 20], jnp.int32)
    (got,), _ = ref_write_frame(kb, vb, k, v, special, patch, num_special=NS, page_size=page)
    got, k = np.asarray(got), np.asarray(k)[0]
    for b, (s, p) in enumerate(((0, T - page), (T - NS, 0), (0, 20))):
        np.testing.assert_array_equal(got[b, s : s + NS], k[b, :NS])
        np.testing.assert_array_equal(got[b, p : p + P], k[b, NS:])
        np.testing.assert_array_equal(got[b, p + P : p + page], 0)


# --- writes through block tables: ids outside the pool write nothing -------------------------------
@gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
def test_flush_write(rng, storage, csa):
    from jaxkv.hybrid import flush as F

    fmt = STORAGES[storage]
    L, NB, bs = 2, 5, 16
    block = np.array([2, -1, -2, NB, NB + 3, I32_MIN, I32_MAX, 4, 4, 4], np.int32)
    slot = np.array([3, 0, 0, 0, 0, 0, 0, -1, bs, I32_MAX], np.int32)
    N = len(block)
    x = jnp.asarray(rng.normal(size=(N, 512)), jnp.bfloat16)
    pool = rng.integers(0, 256, size=(L, NB, bs * fmt.entry_bytes), dtype=np.uint8)
    args = dict(x=x, block=jnp.asarray(block), slot=jnp.asarray(slot))
    if csa:
        ipool = rng.integers(0, 256, size=(L, NB, bs * fmt.index_key_bytes(128)), dtype=np.uint8)
        args.update(index_pool=jnp.asarray(ipool), xi=jnp.asarray(rng.normal(size=(N, 128)), jnp.bfloat16))
    got = jax.jit(F.flush_write_cuda, static_argnames=("layer", "storage"))(
        jnp.asarray(pool), layer=1, storage=storage, **args
    )
    want = jax.jit(F.ref_flush_write, static_argnames=("layer", "storage"))(
        jnp.asarray(pool), layer=1, storage=storage, **args
    )
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        _same(g, w, "flush write")
    before = [pool] + ([ipool] if csa else [])
    for g, b in zip(jax.tree_util.tree_leaves(got), before):  # only block 2 of layer 1 changed
        diff = (np.asarray(g) != b).any(-1)
        assert diff[1, 2] and diff.sum() == 1, np.argwhere(diff)


@gpu
@pytest.mark.parametrize("storage", ["official", "per_entry"])
def test_window_write(rng, storage):
    from jaxkv.errors import Fault
    from jaxkv.kernels import window_write

    fmt = STORAGES[storage]
    L, R, W = 2, 4, 32
    ring = rng.integers(0, 256, size=(L, R, W * fmt.entry_bytes), dtype=np.uint8)
    write_slot = np.array([1, -1, R, I32_MAX, I32_MIN, 2, 3], np.int32)
    start = np.array([I32_MAX, 0, 0, 0, 0, -5, 7], np.int32)
    num_tokens = np.array([1, 1, 1, 1, 1, 1, -3], np.int32)
    x = rng.normal(size=(7, 512))
    x[5, 9] = np.nan  # slot 2's token: not written, NONFINITE_KV in its error word
    error = jnp.zeros((R + 1,), jnp.uint32)
    out, err = jax.jit(window_write, static_argnames=("layer", "storage"))(
        jnp.asarray(ring),
        1,
        jnp.asarray(x, jnp.bfloat16),
        jnp.asarray(write_slot),
        jnp.asarray(start),
        jnp.asarray(num_tokens),
        error,
        storage=storage,
    )
    np.testing.assert_array_equal(np.asarray(err), [0, 0, int(Fault.NONFINITE_KV), 0, 0])
    out = np.asarray(out)
    changed = np.argwhere((out != ring).any(-1))
    np.testing.assert_array_equal(changed, [[1, 1]])  # slot 1's ring, layer 1: nothing else


@gpu
def test_tail_state(rng):
    from jaxkv.hybrid import flush as F

    R = 6
    slots = jnp.asarray([2, -1, R, I32_MAX, I32_MIN], jnp.int32)
    for streams, w, ref, kern in (
        (3, 640, F.ref_csa_rotate_state, F.csa_rotate_state_cuda),
        (1, 512, F.ref_hca_reset_state, F.hca_reset_state_cuda),
    ):
        tails = rng.normal(size=(R, streams, 3, w)).astype(np.float32)
        got = np.asarray(jax.jit(kern)(jnp.asarray(tails), slots))
        _same(got, jax.jit(ref)(jnp.asarray(tails), slots), "tail state")
        np.testing.assert_array_equal(np.delete(got, 2, 0), np.delete(tails, 2, 0))


# --- the fused decode compressor: a table cell outside the pool acts as no block ------------------
@gpu
@pytest.mark.parametrize("bad", ["past-pool", -2, I32_MAX, I32_MIN], ids=["past-pool", "negative", "max", "min"])
def test_compress_decode_table(rng, bad):
    """A flush whose table cell names no block of the pool writes nothing and records
    POOL_EXHAUSTED, exactly as an unallocated cell (-1) does: the whole cache equals that run's."""
    import hybrid_driver as D

    from jaxkv import hybrid as H
    from jaxkv.errors import Fault

    c = H.HybridConfig(
        compress_ratios=(4, 128),
        window=32,
        index_heads=4,
        top_k=16,
        block_size=16,
        max_requests=3,
        max_context=256,
    )
    params = D.make_params(c, rng)
    pos0 = [11, 7, 127]  # every next token completes a CSA entry; request 2's also an HCA one
    x = D.make_inputs(c, rng, 3, 129)
    T = max(pos0)
    slots = jnp.arange(3, dtype=jnp.int32)
    results = []
    for cell in (-1, bad):
        st = H.init(c)
        st, step = H.prepare_forward(st, slots, jnp.zeros(3, jnp.int32), jnp.asarray(pos0), chunk=T)
        st = D.compress_all(st, step, D.slice_tokens(x, 0, T), params, "xla")
        st, step = H.prepare_forward(st, slots, jnp.asarray(pos0), chunk=1)
        tables = []
        for g, (al, (req, blk)) in enumerate(zip(st.alloc, ((0, 0), (2, 0)))):  # CSA: request 0; HCA: 2
            value = st.entries[g].shape[1] if cell == "past-pool" else cell
            tables.append(al.replace(table=al.table.at[req, blk].set(value)))
        st = st.replace(alloc=tuple(tables))
        st = D.compress_all(st, step, D.slice_tokens(x, T, T + 1), params, "cuda")
        results.append(jax.tree.map(np.asarray, st))
    base, got = results
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(base), jax.tree_util.tree_leaves(got)):
        name = jax.tree_util.keystr(path)
        if ".table" not in name:
            _same(b, a, name)
    pe = int(Fault.POOL_EXHAUSTED)
    np.testing.assert_array_equal(np.asarray(got.error)[:3] & pe, [pe, 0, pe])

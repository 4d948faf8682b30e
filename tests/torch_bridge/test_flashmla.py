"""FlashMLA's sm90 sparse FP8 decode (``torch_bridge.flashmla``) on official-family pool bytes
made by jaxkv's own codec, against a float64 reference of sparse attention with a sink over
the same dequantized entries: top-k entries with -1 padding through a block table, plus the
SWA window as FlashMLA's extra cache.

The GPU tests need a Hopper GPU, CUDA torch and ``FLASHMLA_SRC`` (a FlashMLA tree; the
trimmed one: ``tools/flashmla_tree.sh``)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxkv.formats import storage  # noqa: E402
from torch_bridge import flashmla, to_torch  # noqa: E402

DIM = flashmla.HEAD_DIM
CODEC = storage.STORAGES["official"].entry


def _why_not():
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "needs a CUDA build of torch and a visible GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the FlashMLA build here is sm_90a only (Hopper)"
    if not os.environ.get("FLASHMLA_SRC"):
        return "FLASHMLA_SRC is not set: point it at a FlashMLA tree (e.g. .upstream/flashmla) to build and test it"
    return None


def test_model1_entry_is_the_official_family():
    assert flashmla.MODEL1_ENTRY_BYTES == storage.entry_bytes("official")
    assert CODEC.segments == (flashmla.MODEL1_ENTRY_BYTES - 8, 8)  # [data], [7 UE8M0 + pad]: FlashMLA's block
    assert storage.entry_bytes("per_entry") != flashmla.MODEL1_ENTRY_BYTES  # never readable by it


def test_window_ids_follow_the_ring_rule():
    W, slot, position = 8, torch.tensor([2, 0], dtype=torch.int32), torch.tensor([10, 3], dtype=torch.int32)
    ids = flashmla.window_ids(slot, position, W, T=2)  # i32[2, 2, 8]
    for b in range(2):
        for t in range(2):
            p = int(position[b]) + t
            want = {int(slot[b]) * W + k % W for k in range(max(0, p - W + 1), p + 1)}
            got = ids[b, t].tolist()
            assert set(got) - {-1} == want and got.count(-1) == W - len(want)


def test_a_tree_without_a_needed_file_is_named_before_any_build(tmp_path, monkeypatch):
    from jaxkv.cuda import flashmla as ffi_build

    monkeypatch.setattr(flashmla, "_library", None)  # as before a first load in this process
    monkeypatch.setattr(ffi_build, "library", lambda *a: pytest.fail("built from an incomplete tree"))
    csrc = tmp_path / "csrc"
    for f in ffi_build.KEYED + ("cutlass/include/cute/tensor.hpp",):
        if f != "params.h":
            (csrc / f).parent.mkdir(parents=True, exist_ok=True)
            (csrc / f).write_text("// stand-in\n")
    with pytest.raises(ImportError, match="missing under csrc/: params.h"):
        flashmla.load(tmp_path)


def test_launcher_types_match_its_c_signature():
    """The ctypes argument types torch_bridge.flashmla gives the launcher are, one by one, the
    parameters of ``jaxkv_flashmla_sparse_decode`` in jaxkv/cuda/flashmla_sparse_decode.cu
    (the GPU tests need FlashMLA and a Hopper GPU; this runs everywhere)."""
    import ctypes
    import re
    import types

    from jaxkv.cuda import flashmla as ffi_build
    from jaxkv.cuda.build import source_dir

    text = (source_dir() / ffi_build.HANDLER).read_text()
    params = re.search(r'extern "C" int ' + ffi_build.LAUNCHER + r"\(([^)]*)\)", text).group(1)
    kinds = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}
    want = []
    for decl in (" ".join(d.split()) for d in params.split(",")):
        ctype = decl.rsplit(" ", 1)[0].replace("const ", "")
        want.append(ctypes.c_char_p if ctype == "char*" else ctypes.c_void_p if ctype.endswith("*") else kinds[ctype])
    lib = types.SimpleNamespace(**{ffi_build.LAUNCHER: types.SimpleNamespace()})
    got = getattr(flashmla._typed(lib), ffi_build.LAUNCHER).argtypes
    assert got == want


def test_entry_ids_map_through_the_block_table():
    table = torch.tensor([[5, 2], [0, 7]], dtype=torch.int32)
    entries = torch.tensor([[[0, 3, 4, -1]], [[7, -1, 4, 1]]], dtype=torch.int32)  # bs = 4
    assert flashmla.entry_ids(entries, table, 4).tolist() == [[[20, 23, 8, -1]], [[31, -1, 28, 1]]]


def _entries(rng, n):
    """bf16 rows through the official codec: (u8[n, E] items, f64[n, 512] decoded values).
    Tiles of 64 dims get magnitudes 2^-3 .. 2^3 so the UE8M0 scales differ."""
    x = rng.standard_normal((n, DIM)) * np.exp2(rng.integers(-3, 4, (n, DIM // 64, 1))).repeat(64, -1).reshape(n, DIM)
    items = CODEC.encode(jnp.asarray(x, jnp.bfloat16))
    return items, np.asarray(CODEC.decode(items).astype(jnp.float32), np.float64)


def _pool(items, num_blocks, block_size):
    """u8[num_blocks, block_size * E] (a jax array) holding item i at block i // bs, slot i % bs."""
    i = jnp.arange(items.shape[0], dtype=jnp.int32)
    pool = jnp.zeros((1, num_blocks, block_size * CODEC.bytes), jnp.uint8)
    return storage.write_items(pool, 0, i // block_size, i % block_size, items, CODEC.segments)[0]


def _reference(q, keys, valid, sink, scale):
    """f64: out[B, T, H, D] and lse[B, H, T] (over the keys, sink excluded) of softmax with sink."""
    logits = torch.einsum("bthd,btkd->bthk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], -torch.inf)
    m = torch.maximum(logits.amax(-1), sink[None, None, :])
    p = torch.exp(logits - m[..., None])
    denom = p.sum(-1) + torch.exp(sink[None, None, :] - m)
    out = torch.einsum("bthk,btkd->bthd", p, keys) / denom[..., None]
    return out, torch.logsumexp(logits, -1).permute(0, 2, 1)


@pytest.mark.gpu
@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
@pytest.mark.parametrize(
    "H,T,block_size,lengths", [(64, 1, 64, False), (128, 1, 64, False), (128, 2, 32, True), (64, 1, 2, True)]
)
def test_sparse_decode_matches_reference(rng, H, T, block_size, lengths):
    dev = torch.device("cuda")
    B, K, W, blocks_per_req = 5, 128, 128, 6
    NB = B * blocks_per_req + 3
    items, values = _entries(rng, NB * block_size)
    pool_j = _pool(items, NB, block_size)
    pool = to_torch(pool_j)  # zero-copy: FlashMLA reads the jax buffer
    assert pool.data_ptr() == pool_j.unsafe_buffer_pointer()

    R = B + 2  # SWA rings: one block of W items per request slot
    w_items, w_values = _entries(rng, R * W)
    window_j = _pool(w_items, R, W)
    window = to_torch(window_j)

    # top-k: per-request entry numbers through a block table, -1 padding anywhere in the row
    table = torch.tensor(rng.permutation(NB)[: B * blocks_per_req].reshape(B, blocks_per_req), dtype=torch.int32)
    n_ent = blocks_per_req * block_size
    ent = np.full((B, T, K), -1)
    for b in range(B):
        for t in range(T):
            n = min(int(rng.integers(K // 2, K + 1)), n_ent)
            ent[b, t, rng.permutation(K)[:n]] = rng.permutation(n_ent)[:n]
    ent[1, 0] = -1  # a row with no top-k entry: only its window counts
    ids = flashmla.entry_ids(torch.tensor(ent, dtype=torch.int32), table, block_size).to(dev)
    slot = torch.tensor(rng.permutation(R)[:B], dtype=torch.int32, device=dev)
    position = torch.tensor([5, 300, 127, 1000, 64][:B], dtype=torch.int32, device=dev)
    w_ids = flashmla.window_ids(slot, position, W, T)
    topk_length = window_length = None
    if lengths:  # ids past a length are never read, even when garbage
        topk_length = torch.tensor(rng.integers(0, K + 1, B), dtype=torch.int32, device=dev)
        topk_length[0] = 0
        window_length = torch.tensor(rng.integers(1, W + 1, B), dtype=torch.int32, device=dev)
        ids = torch.where(torch.arange(K, device=dev) < topk_length[:, None, None], ids, 2**31 - 1)
        w_ids = torch.where(torch.arange(W, device=dev) < window_length[:, None, None], w_ids, 2**31 - 1)

    q = torch.tensor(rng.standard_normal((B, T, H, DIM)), dtype=torch.bfloat16, device=dev)
    sink = torch.tensor(rng.standard_normal(H) * 2, dtype=torch.float32, device=dev)
    scale = DIM**-0.5
    torch.full((B * T * H * DIM * 4,), torch.nan, device=dev)  # poison memory the outputs may reuse
    sched = flashmla.Schedule()
    out, lse = flashmla.sparse_decode(
        q,
        pool,
        ids,
        block_size=block_size,
        sink=sink,
        scale=scale,
        window=window,
        window_indices=w_ids,
        topk_length=topk_length,
        window_length=window_length,
        schedule=sched,
    )
    again, _ = flashmla.sparse_decode(
        q,
        pool,
        ids,
        block_size=block_size,
        sink=sink,
        scale=scale,
        window=window,
        window_indices=w_ids,
        topk_length=topk_length,
        window_length=window_length,
        schedule=sched,
    )  # the schedule reused
    torch.cuda.synchronize()
    assert out.shape == (B, T, H, DIM) and out.dtype == torch.bfloat16 and lse.shape == (B, H, T)
    assert torch.isfinite(out).all()
    assert torch.equal(out, again)

    # the reference gathers the same decoded entries by the same ids
    all_ids = torch.cat([ids, w_ids], -1).cpu().long()
    in_len = torch.ones_like(all_ids, dtype=torch.bool)
    if lengths:
        in_len[..., :K] = torch.arange(K) < topk_length.cpu()[:, None, None]
        in_len[..., K:] = torch.arange(W) < window_length.cpu()[:, None, None]
    valid = in_len & (all_ids >= 0)
    vals = torch.cat([torch.tensor(values), torch.tensor(w_values)])
    kid = torch.where(valid[..., :K], all_ids[..., :K], 0)
    wid = torch.where(valid[..., K:], all_ids[..., K:], 0) + values.shape[0]
    keys = vals[torch.cat([kid, wid], -1)]  # f64[B, T, K + W, D]
    ref, ref_lse = _reference(q.cpu().double(), keys, valid, sink.cpu().double(), scale)

    got = out.cpu().double()
    err = (got - ref).norm() / ref.norm()
    assert err < 5e-3, f"relative error {err:.2e}"
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    empty = ~valid.any(-1)  # [B, T]
    assert torch.all(got[empty] == 0)
    has = (~empty)[:, None, :].expand(B, H, T)
    torch.testing.assert_close(lse.cpu().double()[has], ref_lse[has], atol=2e-3, rtol=1e-4)

"""The bad-input campaign: the mistakes users make, against every public entry point.

Each row is one mistake. A mistake the host can see (a wrong dtype, rank, shape, name,
static index) raises an error that names the argument; one that depends on data (a
traced index, a repeated slot, a position that goes backwards, an op in the wrong order)
sets a sticky fault, which ``jaxkv.check`` raises. Either way the cache is not corrupted:
after a raise the state passed in is intact and usable (nothing was donated away); after
a fault the state equals the state before, except for its error field.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import formats, frame, kernels
from jaxkv import hybrid as H
from jaxkv.errors import Fault

SPEC = frame.FrameSpec(
    num_layers=2,
    num_heads=2,
    head_dim=8,
    patches_per_frame=5,
    num_special=2,
    scale_frames=1,
    sliding_window=2,
    max_frames=3,
)
CFG = H.HybridConfig(
    compress_ratios=(0, 4, 128), window=16, index_heads=2, top_k=8, block_size=8, max_requests=2, max_context=256
)


def _kv(rng, per_layer=False, dtype=jnp.bfloat16, tokens=None):
    lead = () if per_layer else (SPEC.num_layers,)
    shape = lead + (SPEC.num_streams, tokens or SPEC.tokens_per_frame, SPEC.num_heads, SPEC.head_dim)
    return jnp.asarray(rng.normal(size=shape), dtype)


def _frame_state(rng, frames=1, defer=False):
    st = frame.init(SPEC)
    for t in range(frames):
        st = frame.append(st, _kv(rng), _kv(rng), defer=defer and t == frames - 1)
    return st


def _copy(state):
    return jax.tree.map(lambda x: np.array(x), state)


def _same(a, b, skip=()):
    for (pa, xa), (_, xb) in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    ):
        if not any(s in jax.tree_util.keystr(pa) for s in skip):
            np.testing.assert_array_equal(np.asarray(xa), np.asarray(xb), err_msg=jax.tree_util.keystr(pa))


def _content(state):
    """What a cache holds, without its error field: a frame cache's rows up to the trash rows
    (skipped writes land there; nothing reads them) and not its write-row registers."""
    if isinstance(state, frame.FrameCacheState):
        t = SPEC.trash_row
        return dict(
            k=[x[:, :t] for x in state.k],
            v=[x[:, :t] for x in state.v],
            token_id=state.token_id[:, :t],
            counters=[
                state.num_frames,
                state.num_scale,
                state.num_window,
                state.window_head,
                state.num_special,
                state.pending,
            ],
        )
    return dict(
        position=state.position,
        window=state.window,
        tails=state.tails,
        entries=state.entries,
        index_keys=state.index_keys,
        alloc=state.alloc,
    )


# --- mistakes the host sees: (name, make state, call, exception, message) ---------------------------
def _hybrid_step(slots=(0, 1)):
    st = H.init(CFG)
    return H.prepare_forward(st, jnp.asarray(slots, jnp.int32), jnp.zeros(len(slots), jnp.int32))


def _flax_layer(**kw):
    nnx = pytest.importorskip("flax.nnx")
    from jaxkv.flax import StreamingGlobalAttention

    args = dict(patches_per_frame=SPEC.patches_per_frame, num_special=SPEC.num_special, max_frames=4)
    return StreamingGlobalAttention(16, 2, **{**args, **kw}, rngs=nnx.Rngs(0))


def _flax_cache():
    pytest.importorskip("flax")
    from jaxkv.flax import FrameCacheModule

    return FrameCacheModule(SPEC)


def _flax_call(tokens):
    layer = _flax_layer()
    x = jnp.ones((1, tokens, 16))
    cs = jnp.ones((1, tokens, 4))
    return layer(x, cs, cs)


def _lingbot(**changes):
    pytest.importorskip("flax")
    from jaxkv.models.lingbot import LingbotConfig

    return LingbotConfig.small(**changes)


def _manager():
    """A small drop-in manager on CPU (rows with it skip without torch)."""
    torch = pytest.importorskip("torch")
    from torch_bridge import FlashInferKVCacheManager

    return torch, FlashInferKVCacheManager(
        2, 8, 10, 2, 8, torch.bfloat16, "cpu", num_special_tokens=2, scale_frames=1, sliding_window=2
    )


def _append(k_shape=(10, 2, 8), block=0, integer=False):
    torch, m = _manager()
    k = torch.randint(0, 3, k_shape) if integer else torch.randn(k_shape)
    m.append_frame(block, k, torch.randn(10, 2, 8))


RAISES = [
    (
        "frame.append: a list for k",
        "frame",
        lambda st, r: frame.append(st, _kv(r).tolist(), _kv(r)),
        ValueError,
        r"k: expected an array bfloat16\[2, 1, 7, 2, 8\], got a list",
    ),
    (
        "frame.append: one layer's k",
        "frame",
        lambda st, r: frame.append(st, _kv(r, True), _kv(r, True)),
        ValueError,
        r"k: expected bfloat16\[2, 1, 7, 2, 8\].*got bfloat16\[1, 7, 2, 8\]",
    ),
    (
        "frame.append: float32 into bf16",
        "frame",
        lambda st, r: frame.append(st, _kv(r, dtype=jnp.float32), _kv(r)),
        ValueError,
        r"k: expected bfloat16.*got float32",
    ),
    (
        "frame.append: v of another shape",
        "frame",
        lambda st, r: frame.append(st, _kv(r), _kv(r, tokens=5)),
        ValueError,
        r"v: expected bfloat16\[2, 1, 7, 2, 8\].*got bfloat16\[2, 1, 5, 2, 8\]",
    ),
    (
        "frame.append: defer for 3 streams",
        "frame",
        lambda st, r: frame.append(st, _kv(r), _kv(r), defer=jnp.ones(3, bool)),
        ValueError,
        r"defer: expected a scalar or shape \(1,\)",
    ),
    (
        "frame.append: impl name",
        "frame",
        lambda st, r: frame.append(st, _kv(r), _kv(r), impl="triton"),
        ValueError,
        r"impl: expected one of \('auto', 'xla', 'pallas', 'cuda'\)",
    ),
    (
        "frame.append: a state of another spec",
        "frame",
        lambda st, r: frame.append(
            frame.init(frame.FrameSpec(num_layers=3, num_heads=2, head_dim=8, patches_per_frame=5, num_special=2)),
            _kv(r),
            _kv(r),
        ),
        ValueError,
        r"k: expected bfloat16\[3, 1, 7, 2, 8\]",
    ),
    (
        "frame.write_layer: layer 2 of 2",
        "frame_open",
        lambda st, r: frame.write_layer(st, 2, _kv(r, True), _kv(r, True)),
        ValueError,
        r"layer: expected 0 <= layer < 2, got 2",
    ),
    (
        "frame.attention: layer -1",
        "frame",
        lambda st, r: frame.attention(st, -1, _kv(r, True)),
        ValueError,
        r"layer: expected 0 <= layer < 2, got -1",
    ),
    (
        "frame.attention: q of another head_dim",
        "frame",
        lambda st, r: frame.attention(st, 0, _kv(r, True)[..., :4]),
        ValueError,
        r"q: expected \[streams=1, tokens, heads \(a multiple of 2\), head_dim=8\]",
    ),
    (
        "frame.attention: q float32 on a bf16 cache",
        "frame",
        lambda st, r: frame.attention(st, 0, _kv(r, True, jnp.float32), impl="xla"),
        ValueError,
        r"q: expected dtype bfloat16 \(the cache's\)",
    ),
    (
        "frame.attention: impl name",
        "frame",
        lambda st, r: frame.attention(st, 0, _kv(r, True), impl="flash"),
        ValueError,
        r"impl: expected one of",
    ),
    (
        "frame.resolve: keep for 2 streams",
        "frame",
        lambda st, r: frame.resolve(st, jnp.ones(2, bool)),
        ValueError,
        r"keep: expected a scalar or shape \(1,\)",
    ),
    (
        "frame.grow: smaller",
        "frame",
        lambda st, r: frame.grow(st, 2),
        ValueError,
        r"max_frames: expected >= the current 3, got 2",
    ),
    (
        "frame.init: a dict",
        "frame",
        lambda st, r: frame.init({"num_layers": 2}),
        TypeError,
        r"spec: expected a jaxkv.frame.FrameSpec, got dict",
    ),
    (
        "frame.FrameSpec: 0 heads",
        "frame",
        lambda st, r: frame.FrameSpec(num_layers=1, num_heads=0, head_dim=8, patches_per_frame=5),
        ValueError,
        r"FrameSpec.num_heads: expected a positive int, got 0",
    ),
    (
        "frame.FrameSpec: int8",
        "frame",
        lambda st, r: frame.FrameSpec(num_layers=1, num_heads=1, head_dim=8, patches_per_frame=5, dtype="int8"),
        ValueError,
        r"FrameSpec.dtype: expected",
    ),
    (
        "hybrid.init: a dict",
        "hybrid",
        lambda st, r: H.init({"compress_ratios": (4,)}),
        TypeError,
        r"config: expected a jaxkv.hybrid.HybridConfig, got dict",
    ),
    (
        "hybrid.HybridConfig: ratio 1",
        "hybrid",
        lambda st, r: H.HybridConfig(compress_ratios=(1,)),
        ValueError,
        r"compress_ratios: expected 0 \(SWA\) or a ratio >= 2, got 1",
    ),
    (
        "hybrid.HybridConfig: storage name",
        "hybrid",
        lambda st, r: H.HybridConfig(compress_ratios=(4,), storage="fp8"),
        ValueError,
        r"storage: expected one of \['official', 'per_entry'\], got 'fp8'",
    ),
    (
        "hybrid.prepare_forward: float slots",
        "hybrid",
        lambda st, r: H.prepare_forward(st, jnp.array([0.0, 1.0]), jnp.array([0, 0])),
        ValueError,
        r"slots: expected an integer array, got dtype float32",
    ),
    (
        "hybrid.prepare_forward: positions of another length",
        "hybrid",
        lambda st, r: H.prepare_forward(st, jnp.array([0, 1]), jnp.array([0, 0, 0])),
        ValueError,
        r"positions: expected shape \(2,\), got \(3,\)",
    ),
    (
        "hybrid.prepare_forward: chunk 0",
        "hybrid",
        lambda st, r: H.prepare_forward(st, jnp.array([0, 1]), jnp.array([0, 0]), chunk=0),
        ValueError,
        r"chunk: expected a positive int, got 0",
    ),
    (
        "hybrid.write_window: kv 256 wide",
        "hybrid",
        lambda st, r: H.write_window(*_hybrid_step(), 0, jnp.ones((2, 1, 256), jnp.bfloat16)),
        ValueError,
        r"kv: expected shape \[2, T, 512\], got \(2, 1, 256\)",
    ),
    (
        "hybrid.write_window: kv float32",
        "hybrid",
        lambda st, r: H.write_window(*_hybrid_step(), 0, jnp.ones((2, 1, 512), jnp.float32)),
        ValueError,
        r"kv: expected dtype bfloat16, got float32",
    ),
    (
        "hybrid.write_window: layer 9",
        "hybrid",
        lambda st, r: H.write_window(*_hybrid_step(), 9, jnp.ones((2, 1, 512), jnp.bfloat16)),
        ValueError,
        r"layer: expected a static int in \[0, 3\), got 9",
    ),
    (
        "hybrid.compress: an SWA layer",
        "hybrid",
        lambda st, r: H.compress(*_hybrid_step(), 0, jnp.ones((2, 1, 512)), jnp.ones((2, 1, 512)), None),
        ValueError,
        r"layer: expected a CSA or HCA layer, layer 0 is SWA",
    ),
    (
        "hybrid.compress: params None",
        "hybrid",
        lambda st, r: H.compress(*_hybrid_step(), 2, jnp.ones((2, 1, 512)), jnp.ones((2, 1, 512)), None),
        ValueError,
        r"params: expected the layer's CompressorParams\(bias, norm\), got NoneType",
    ),
    (
        "hybrid.gather_entries: float indices",
        "hybrid",
        lambda st, r: H.gather_entries(*_hybrid_step(), 1, jnp.zeros((2, 1, 8))),
        ValueError,
        r"idx: expected an integer array of entry indices",
    ),
    (
        "hybrid.gather_entries: impl name",
        "hybrid",
        lambda st, r: H.gather_entries(*_hybrid_step(), 1, jnp.zeros((2, 1, 8), jnp.int32), impl="triton"),
        ValueError,
        r"impl: expected one of \('auto', 'xla', 'cuda'\)",
    ),
    (
        "formats.quantize_mxfp4: 33 wide",
        None,
        lambda st, r: formats.quantize_mxfp4(jnp.ones((3, 33))),
        ValueError,
        r"x: expected a last dimension that is a multiple of 32, got shape \(3, 33\)",
    ),
    (
        "formats.quantize_fp8_ue8m0: int32",
        None,
        lambda st, r: formats.quantize_fp8_ue8m0(jnp.ones((3, 64), jnp.int32)),
        ValueError,
        r"x: expected a floating-point array, got dtype int32",
    ),
    (
        "formats.pack_ds_mla: 500 wide",
        None,
        lambda st, r: formats.pack_ds_mla(jnp.ones((3, 500))),
        ValueError,
        r"kv: expected shape \[blocks, block_size, 512\], got \(3, 500\)",
    ),
    (
        "kernels.flush_write: storage name",
        None,
        lambda st, r: kernels.flush_write(
            jnp.zeros((1, 2, 584 * 4), jnp.uint8),
            0,
            jnp.ones((1, 512), jnp.bfloat16),
            jnp.array([0]),
            jnp.array([0]),
            storage="fp8",
        ),
        ValueError,
        r"storage: expected one of \['official', 'per_entry'\], got 'fp8'",
    ),
    (
        "kernels.dequant_gather: pool 100 wide",
        None,
        lambda st, r: kernels.dequant_gather(jnp.zeros((1, 2, 100), jnp.uint8), 0, jnp.array([0]), jnp.array([0])),
        ValueError,
        r"pool: expected u8\[layers, blocks, block_size \* 584\] \(official storage\)",
    ),
    (
        "kernels.prefix_attention: float32",
        None,
        lambda st, r: kernels.prefix_attention(
            jnp.zeros((1, 64, 2, 64)), jnp.zeros((1, 128, 2, 64)), jnp.zeros((1, 128, 2, 64)), jnp.array([3], jnp.int32)
        ),
        ValueError,
        r"q, k, v: expected one dtype, bfloat16 or float16",
    ),
    (
        "models.lingbot.LingbotConfig: height 43",
        None,
        lambda st, r: _lingbot(height=43),
        ValueError,
        r"height, width: expected positive multiples of patch_size=14, got 43x56",
    ),
    (
        "models.lingbot.LingbotConfig: window 0",
        None,
        lambda st, r: _lingbot(kv_cache_sliding_window=0),
        ValueError,
        r"kv_cache_sliding_window: expected >= 0 and >= 1, got 2, 0",
    ),
    (
        "models.lingbot.LingbotConfig: int8",
        None,
        lambda st, r: _lingbot(dtype="int8"),
        ValueError,
        r"dtype: expected 'bfloat16' or 'float32', got 'int8'",
    ),
    (
        "flax.StreamingGlobalAttention: impl name",
        None,
        lambda st, r: _flax_layer(impl="triton"),
        ValueError,
        r"impl: expected one of \('auto', 'reference'",
    ),
    (
        "flax.StreamingGlobalAttention: no patches_per_frame",
        None,
        lambda st, r: _flax_layer(patches_per_frame=None),
        ValueError,
        r"patches_per_frame: expected an int when the layer owns its cache",
    ),
    (
        "flax.StreamingGlobalAttention: a frame of 6 tokens",
        None,
        lambda st, r: _flax_call(6),
        ValueError,
        r"x: expected \[streams=1, tokens_per_frame=7, dim=16\]",
    ),
    (
        "flax.StreamingGlobalAttention: layer 3 of a 2-layer cache",
        None,
        lambda st, r: _flax_layer(cache=_flax_cache(), layer=3),
        ValueError,
        r"layer: expected 0 <= layer < 2 \(the cache's layers\), got 3",
    ),
    (
        "torch_bridge: a frame of 9 tokens",
        None,
        lambda st, r: _append(k_shape=(9, 2, 8)),
        ValueError,
        r"k: expected a tensor of shape \[10, 2, 8\].*got \(9, 2, 8\)",
    ),
    (
        "torch_bridge: block 2 of 2",
        None,
        lambda st, r: _append(block=2),
        ValueError,
        r"block_idx: expected an int in \[0, 2\), got 2",
    ),
    (
        "torch_bridge: integer k",
        None,
        lambda st, r: _append(integer=True),
        ValueError,
        r"k: expected a floating-point tensor",
    ),
    (
        "torch_bridge: camera_only",
        None,
        lambda st, r: _manager()[1].evict_frames(0, 1, 2, camera_only=True),
        ValueError,
        r"camera_only: this manager implements only camera_only=False",
    ),
    (
        "torch_bridge: backend name",
        None,
        lambda st, r: type(_manager()[1])(2, 8, 10, 2, 8, _manager()[0].bfloat16, "cpu", 2, backend="flash"),
        ValueError,
        r"backend: expected one of \('auto', 'sdpa'",
    ),
    (
        "jaxkv.save: a dict",
        None,
        lambda st, r: jaxkv.save("/nonexistent/x", {"k": jnp.ones(3)}),
        TypeError,
        r"state: expected a frame.FrameCacheState or hybrid.HybridCacheState, got dict",
    ),
]


@pytest.mark.parametrize("name, kind, call, exc, match", RAISES, ids=[r[0] for r in RAISES])
def test_a_mistake_raises_naming_the_argument_and_the_cache_survives(rng, name, kind, call, exc, match):
    state = {
        "frame": lambda: _frame_state(rng),
        "frame_open": lambda: frame.begin_frame(_frame_state(rng)),
        "hybrid": lambda: H.init(CFG),
        None: lambda: None,
    }[kind]()
    before = _copy(state) if state is not None else None
    with pytest.raises(exc, match=match):
        call(state, rng)
    if state is not None:  # intact and usable: not donated, not changed
        _same(state, before)
        jaxkv.check(state)


# --- mistakes only the data shows: a sticky fault; the cache equals a replay of the valid ops ----------
# Each maker returns (the state a replay of only the valid operations gives, the state after the mistake).
def _rollback_nothing(rng):
    st = _frame_state(rng)
    return _copy(st), frame.rollback(st)


def _append_while_pending(rng):
    st = _frame_state(rng, frames=2, defer=True)
    return _copy(st), frame.append(st, _kv(rng), _kv(rng))


def _special_capacity(rng):
    st = _frame_state(rng, frames=3)  # max_frames = 3: the specials are full
    return _copy(st), frame.append(st, _kv(rng), _kv(rng))


def _write_without_frame(rng):
    st = frame.commit(frame.begin_frame(_frame_state(rng)))  # committed: no frame open
    return _copy(st), frame.write_layer(st, 0, _kv(rng, True), _kv(rng, True))


def _traced_layer(rng):
    st = frame.begin_frame(_frame_state(rng))
    return _copy(st), jax.jit(frame.write_layer)(st, jnp.int32(5), _kv(rng, True), _kv(rng, True))


def _poison(x, value, where):
    """``x`` with ``value`` (NaN or Inf) at index ``where``."""
    return x.at[where].set(value)


def _nonfinite_append(rng):
    st = _frame_state(rng)
    k = _poison(_kv(rng), jnp.nan, (1, 0, 3, 1, 2))  # layer 1, stream 0
    return _copy(st), frame.append(st, k, _kv(rng))


def _nonfinite_write_layer(rng):
    st = frame.begin_frame(_frame_state(rng))
    return _copy(st), frame.write_layer(st, 1, _kv(rng, True), _poison(_kv(rng, True), -jnp.inf, (0, 6, 0, 7)))


def _admitted(rng, chunk=4):
    """Both requests admitted for a ``chunk``-token step (a valid operation), and its Step."""
    return H.prepare_forward(_prefilled(), jnp.array([0, 1]), jnp.array([4, 4]), chunk=chunk)


def _only(step, b):
    """``step`` restricted to batch row ``b`` (what a replay without the other row writes)."""
    return jax.tree.map(lambda x: x[b : b + 1], step)


def _nonfinite_write_window(rng):
    st, step = _admitted(rng)
    kv = jnp.asarray(rng.normal(size=(2, 4, CFG.head_dim)), jnp.bfloat16)
    replay = H.write_window(_copy_j(st), _only(step, 1), 0, kv[1:])
    return _copy(replay), H.write_window(st, step, 0, _poison(kv, jnp.nan, (0, 2, 5)))


def _nonfinite_compress(rng):
    st, step = _admitted(rng)
    layer, ratio = 2, CFG.compress_ratios[2]  # HCA
    params = H.CompressorParams(
        jnp.asarray(rng.normal(size=(ratio, CFG.head_dim)), jnp.float32),
        jnp.asarray(1 + 0.1 * rng.normal(size=(CFG.head_dim,)), jnp.float32),
    )
    kv, score = (jnp.asarray(rng.normal(size=(2, 4, CFG.head_dim)), jnp.float32) for _ in range(2))
    replay = H.compress(_copy_j(st), _only(step, 0), layer, kv[:1], score[:1], params)
    return _copy(replay), H.compress(st, step, layer, kv, _poison(score, jnp.inf, (1, 3, 0)), params)


def _nonfinite_index_scores(rng):
    st, step = _admitted(rng)
    q = H.index_query(st, jnp.asarray(rng.normal(size=(2, 4, CFG.index_heads, CFG.index_dim)), jnp.bfloat16))
    w = jnp.asarray(rng.normal(size=(2, 4, CFG.index_heads)), jnp.float32)
    return _copy(st), H.index_topk(st, step, 1, q, _poison(w, jnp.nan, (1, 3, 0)))[0]


def _copy_j(state):
    """A device copy (the ops donate their state)."""
    return jax.tree.map(jnp.array, state)


def _prefilled():
    return H.prepare_forward(H.init(CFG), jnp.array([0, 1]), jnp.array([0, 0]), chunk=4)[0]


def _hybrid_bad(slots, positions, valid):
    """prepare_forward of rows ``slots, positions``; ``valid``: the rows that are not mistakes."""

    def make(rng):
        sl, pos = jnp.asarray(slots, jnp.int32), jnp.asarray(positions, jnp.int32)
        replay = _prefilled()
        if valid:
            replay = H.prepare_forward(replay, sl[jnp.array(valid)], pos[jnp.array(valid)])[0]
        return _copy(replay), H.prepare_forward(_prefilled(), sl, pos)[0]

    return make


def _finish_out_of_range(rng):
    st = _prefilled()
    return _copy(st), H.finish(st, jnp.array([5], jnp.int32))


def _finish_twice(rng):
    st = H.finish(_prefilled(), jnp.array([0], jnp.int32))
    return _copy(st), H.finish(st, jnp.array([0], jnp.int32))


FAULTS = [
    ("frame.rollback with nothing pending", _rollback_nothing, Fault.ROLLBACK_NOTHING_PENDING),
    ("frame.append while a frame is pending", _append_while_pending, Fault.APPEND_WHILE_PENDING),
    ("frame.append past the special capacity", _special_capacity, Fault.SPECIAL_CAPACITY),
    ("frame.write_layer with no frame begun", _write_without_frame, Fault.WRITE_WITHOUT_FRAME),
    ("frame.write_layer at traced layer 5", _traced_layer, Fault.LAYER_OUT_OF_RANGE),
    ("hybrid.prepare_forward: a repeated slot", _hybrid_bad([1, 1], [4, 4], []), Fault.SLOT_REPEATED),
    ("hybrid.prepare_forward: slot 7 of 2", _hybrid_bad([0, 7], [4, 0], [0]), Fault.SLOT_OUT_OF_RANGE),
    ("hybrid.prepare_forward: a position backwards", _hybrid_bad([0, 1], [2, 4], [1]), Fault.POSITION_BACKWARDS),
    ("hybrid.prepare_forward: a position gap", _hybrid_bad([0, 1], [9, 4], [1]), Fault.POSITION_GAP),
    ("hybrid.finish: slot 5 of 2", _finish_out_of_range, Fault.SLOT_OUT_OF_RANGE),
    ("hybrid.finish: a slot released twice", _finish_twice, Fault.SLOT_EMPTY),
    ("frame.append: NaN in one stream's K", _nonfinite_append, Fault.NONFINITE_KV),
    ("frame.write_layer: -Inf in V", _nonfinite_write_layer, Fault.NONFINITE_KV),
    ("hybrid.write_window: NaN in one row", _nonfinite_write_window, Fault.NONFINITE_KV),
    ("hybrid.compress: Inf in one row's score", _nonfinite_compress, Fault.NONFINITE_KV),
    ("hybrid.index_topk: NaN in one row's weights", _nonfinite_index_scores, Fault.NONFINITE_SCORES),
]


@pytest.mark.parametrize("name, make, fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_data_mistake_is_a_sticky_fault_and_the_rest_is_a_replay(rng, name, make, fault):
    replay, after = make(rng)
    with pytest.raises(jaxkv.CacheError) as e:
        jaxkv.check(after)
    assert any(fault in f for f in e.value.faults.values()), (e.value.faults, fault)
    _same(_content(after), _content(replay))
    assert int(np.max(np.asarray(jaxkv.clear_errors(after).error))) == 0

"""The frame cache against the seed's semantics, its page table, errors and attention."""

import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from frame_model import FrameModel

import jaxkv
from jaxkv import frame
from jaxkv.errors import CacheError, Fault

frame_tuning = importlib.import_module("jaxkv.frame.tuning")

SMALL = dict(
    num_layers=2,
    num_heads=2,
    head_dim=8,
    patches_per_frame=5,
    num_special=2,
    scale_frames=2,
    sliding_window=3,
    max_frames=30,
    dtype="float32",
)


def rand_frame(rng, spec, per_layer=False):
    lead = () if per_layer else (spec.num_layers,)
    shape = lead + (spec.num_streams, spec.tokens_per_frame, spec.num_heads, spec.head_dim)
    k = jnp.asarray(rng.standard_normal(shape), spec.jnp_dtype)
    v = jnp.asarray(rng.standard_normal(shape), spec.jnp_dtype)
    return k, v


def visible(state, b=0):
    ids = np.asarray(frame.visible_token_ids(state))[b]
    return sorted(ids[ids >= 0].tolist())


def test_sanity_check_scenario():
    """The seed's _sanity_check: 100 frames of 256 + 6 tokens, S=8, W=64."""
    spec = frame.FrameSpec(
        num_layers=2,
        num_heads=1,
        head_dim=8,
        patches_per_frame=256,
        num_special=6,
        scale_frames=8,
        sliding_window=64,
        max_frames=200,
        dtype="bfloat16",
    )
    state = frame.init(spec)
    rng = np.random.default_rng(0)
    k, v = rand_frame(rng, spec)
    for _ in range(100):
        state = frame.append(state, k, v)
    jaxkv.check(state)
    assert int(state.num_scale[0]) == 8 and int(state.num_window[0]) == 64
    assert int(state.num_special[0]) == 600
    pt = frame.page_table(state)
    n_pages = int(pt.num_pages[0])
    n_spec_pages = n_pages - 72
    assert n_spec_pages == math.ceil(600 / 256) == 3
    assert int(pt.last_page_len[0]) == 600 % 256 == 88
    idx = np.asarray(pt.indices[0, :n_pages])
    assert len(set(idx.tolist())) == n_pages  # no page twice
    assert np.all(idx[:72] < spec.num_slots) and np.all(idx[72:] >= spec.num_slots)
    assert idx[:8].tolist() == list(range(8))  # scale pages first, in order
    # window pages oldest first: frames 36..99 live in ring slots
    tid = np.asarray(state.token_id[0]).reshape(-1, 256)
    frames_in_order = [int(tid[p, 0]) // 262 for p in idx[:72]]
    assert frames_in_order == list(range(8)) + list(range(36, 100))
    assert int(frame.num_frames(state)[0]) == 100
    state = frame.reset(state)
    assert int(frame.num_frames(state)[0]) == 0 and visible(state) == []


@pytest.mark.parametrize("pow2", [False, True])
def test_visible_set_follows_seed_with_deferral(rng, pow2):
    spec = frame.FrameSpec(**SMALL, pow2_pages=pow2)
    state = frame.init(spec)
    model = FrameModel(2, 3, 5, 2, 30)
    ops = ["a", "a", "d+", "d-", "a", "a", "d-", "a", "d+", "a", "a", "d-", "d+", "a"]
    for op in ops:
        k, v = rand_frame(rng, spec)
        state = frame.append(state, k, v, defer=op != "a")
        assert model.append(op != "a")
        if op != "a":
            assert visible(state) == model.visible_ids()  # pending frame visible, window W+1
            state = frame.resolve(state, op == "d+")
            model.resolve(op == "d+")
        assert visible(state) == model.visible_ids(), op
    jaxkv.check(state)


@pytest.mark.parametrize("branch_free", [False, True])
def test_cache_without_specials_keeps_its_rows(rng, monkeypatch, branch_free):
    """num_special=0 (lingbot-map's camera head caches): a new frame moves no rows, so the
    step has no copy for it; through scale frames, eviction, deferrals and rollbacks the
    visible rows are the model's and hold their tokens' K."""
    monkeypatch.setattr(frame_tuning, "SYNCING_CONTROL_FLOW", (jax.devices()[0].platform,) if branch_free else ())
    jax.clear_caches()
    spec = frame.FrameSpec(**{**SMALL, "num_special": 0})
    state, model, kept = frame.init(spec), FrameModel(2, 3, 5, 0, 30), {}
    for i, op in enumerate(["a", "a", "d+", "d-", "a", "a", "d-", "a", "d+", "a", "a", "d-", "d+", "a"]):
        k, v = rand_frame(rng, spec)
        state = frame.append(state, k, v, defer=op != "a")
        assert model.append(op != "a")
        kept[int(np.asarray(frame.num_frames(state))[0]) - 1] = np.asarray(k[0, 0])  # [tokens, H, D]
        if op != "a":
            state = frame.resolve(state, op == "d+")
            model.resolve(op == "d+")
        assert visible(state) == model.visible_ids(), (i, op)
    jax.clear_caches()
    jaxkv.check(state)
    ids, mask = np.asarray(state.token_id)[0], np.asarray(frame.visible_mask(state))[0]
    rows = np.asarray(state.k[0])[0]
    T = spec.tokens_per_frame
    for r in np.nonzero(mask)[0]:
        np.testing.assert_array_equal(rows[r], kept[ids[r] // T][ids[r] % T])


def test_page_table_covers_visible_rows(rng):
    spec = frame.FrameSpec(**SMALL)
    state = frame.init(spec)
    for t in range(9):
        state = frame.append(state, *rand_frame(rng, spec), defer=t == 8)
        pt = frame.page_table(state)
        n = int(pt.num_pages[0])
        idx = np.asarray(pt.indices[0, :n])
        rows = np.concatenate(
            [np.arange(p * 5, p * 5 + 5) for p in idx[:-1]]
            + [np.arange(idx[-1] * 5, idx[-1] * 5 + int(pt.last_page_len[0]))]
        )
        ids = np.asarray(state.token_id[0])[rows]
        assert sorted(ids.tolist()) == visible(state)


def test_errors_are_sticky_and_leave_cache_unchanged(rng):
    spec = frame.FrameSpec(**{**SMALL, "max_frames": 4})
    state = frame.init(spec)
    for _ in range(4):
        state = frame.append(state, *rand_frame(rng, spec))
    before = jax.tree.map(np.asarray, state)
    state = frame.append(state, *rand_frame(rng, spec))  # special capacity exhausted
    after = jax.tree.map(np.asarray, state)
    assert int(after.error[0]) == Fault.SPECIAL_CAPACITY
    keep = slice(0, spec.trash_row)  # skipped writes land in the trash rows, nothing else moves
    for name in ("k", "v"):
        np.testing.assert_array_equal(
            np.stack(getattr(after, name))[:, :, keep], np.stack(getattr(before, name))[:, :, keep]
        )
    np.testing.assert_array_equal(after.token_id[:, keep], before.token_id[:, keep])
    for name in ("num_frames", "num_special", "num_window", "window_head", "pending"):
        np.testing.assert_array_equal(getattr(after, name), getattr(before, name), err_msg=name)
    with pytest.raises(CacheError, match="special-token capacity exhausted"):
        jaxkv.check(state)
    state = frame.rollback(state)  # nothing pending: another bit, still nothing changed
    with pytest.raises(CacheError, match="nothing to roll back"):
        jaxkv.check(state)
    np.testing.assert_array_equal(np.stack(state.k)[:, :, keep], np.stack(before.k)[:, :, keep])
    state = jaxkv.clear_errors(state)
    jaxkv.check(state)


def test_append_while_pending_and_grow(rng):
    spec = frame.FrameSpec(**{**SMALL, "max_frames": 3})
    state = frame.append(frame.init(spec), *rand_frame(rng, spec), defer=True)
    ids = visible(state)
    state = frame.append(state, *rand_frame(rng, spec))
    assert int(state.error[0]) == Fault.APPEND_WHILE_PENDING and visible(state) == ids
    state = jaxkv.clear_errors(frame.commit(state))
    for _ in range(2):
        state = frame.append(state, *rand_frame(rng, spec))
    state = frame.grow(state, 6)
    assert state.spec.max_frames == 6
    for _ in range(3):
        state = frame.append(state, *rand_frame(rng, spec))
    jaxkv.check(state)
    model = FrameModel(2, 3, 5, 2, 6)
    for _ in range(6):
        model.append(False)
    assert visible(state) == model.visible_ids()


def test_grow_leaves_the_old_state_whole(rng):
    """frame.grow copies: donating the grown state (every functional op does) deletes none
    of the old state's arrays, and the old state still appends as before."""
    spec = frame.FrameSpec(**{**SMALL, "max_frames": 3})
    state = frame.append(frame.init(spec), *rand_frame(rng, spec))
    grown = frame.grow(state, 6)
    olds = {id(x) for x in jax.tree.leaves(state)}
    assert not olds & {id(x) for x in jax.tree.leaves(grown)}
    frame.append(grown, *rand_frame(rng, spec))  # donates grown
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    state = frame.append(state, *rand_frame(rng, spec))
    jaxkv.check(state)
    assert int(state.num_frames[0]) == 2


def test_bad_inputs_raise_clearly(rng):
    spec = frame.FrameSpec(**SMALL)
    state = frame.init(spec)
    k, v = rand_frame(rng, spec)
    with pytest.raises(ValueError, match=r"k: expected float32\[2, 1, 7, 2, 8\].*got float32\[2, 1, 6, 2, 8\]"):
        frame.append(state, k[:, :, :6], v)
    with pytest.raises(ValueError, match="v: expected float32.*got bfloat16"):
        frame.append(state, k, v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="layer: expected 0 <= layer < 2, got 5"):
        frame.write_layer(frame.begin_frame(state), 5, k[0], v[0])
    with pytest.raises(ValueError, match="q: expected"):
        frame.attention(state, 0, k[0, :, :, :, :4])
    with pytest.raises(ValueError, match="impl"):
        frame.attention(state, 0, k[0], impl="flash")
    with pytest.raises(ValueError, match=r"impl='pallas'.*expected an NVIDIA Hopper GPU.*head_dim 8"):
        frame.attention(state, 0, k[0], impl="pallas")  # head_dim 8 (and here no Hopper either)
    with pytest.raises(ValueError, match="FrameSpec.patches_per_frame"):
        frame.FrameSpec(num_layers=1, num_heads=1, head_dim=8, patches_per_frame=0)
    with pytest.raises(ValueError, match="defer"):
        frame.append(state, k, v, defer=jnp.ones((3,), bool))


def test_traced_layer_out_of_range_is_recorded(rng):
    spec = frame.FrameSpec(**SMALL)
    state = frame.begin_frame(frame.init(spec))
    k, v = rand_frame(rng, spec, per_layer=True)
    before = np.stack(state.k)
    state = jax.jit(frame.write_layer)(state, jnp.int32(7), k, v)
    assert int(state.error[0]) & Fault.LAYER_OUT_OF_RANGE
    keep = slice(0, spec.trash_row)
    np.testing.assert_array_equal(np.stack(state.k)[:, :, keep], before[:, :, keep])


def test_per_layer_equals_all_layers(rng):
    spec = frame.FrameSpec(**SMALL)
    a, b = frame.init(spec), frame.init(spec)
    for t in range(7):
        k, v = rand_frame(rng, spec)
        a = frame.append(a, k, v, defer=t % 3 == 2)
        b = frame.begin_frame(b, defer=t % 3 == 2)
        for layer in range(spec.num_layers):
            b = frame.write_layer(b, layer, k[layer], v[layer])
        if t % 3 == 2:
            a, b = frame.rollback(a), frame.rollback(b)
    va, vb = np.asarray(frame.visible_mask(a)), np.asarray(frame.visible_mask(b))
    np.testing.assert_array_equal(va, vb)
    np.testing.assert_array_equal(np.stack(a.k)[:, va], np.stack(b.k)[:, vb])
    np.testing.assert_array_equal(np.stack(a.v)[:, va], np.stack(b.v)[:, vb])


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_frames_written_by_layer_equal_appends(rng, dtype):
    """S frames begun together, then each layer's K/V of all S stored at once, leave the
    cache an append per frame leaves: from empty (the scale frames) and from a cache whose
    window overflows while the frames are begun, with two streams."""
    spec = frame.FrameSpec(**dict(SMALL, dtype=dtype, num_streams=2))
    kv = lambda: rand_frame(rng, frame.FrameSpec(**dict(SMALL, num_streams=2)))  # noqa: E731
    cast = lambda x: x.astype(spec.compute_dtype)  # noqa: E731
    a, b = frame.init(spec), frame.init(spec)
    for S in (2, 4):  # the scale frames, then four frames through eviction
        frames = [kv() for _ in range(S)]
        first = np.asarray(b.num_frames)  # read before the begins donate the state
        for k, v in frames:
            a = frame.append(a, cast(k), cast(v))
            b = frame.begin_frame(b)
        for layer in range(spec.num_layers):
            k, v = (jnp.concatenate([f[i][layer] for f in frames], axis=1) for i in (0, 1))  # [B, S*T, H, D]
            b = frame.write_frames(b, layer, cast(k), cast(v), first)
        np.testing.assert_array_equal(np.asarray(a.token_id), np.asarray(b.token_id))
        mask = np.asarray(frame.visible_mask(a))
        for name in ("k", "v", "k_scale", "v_scale"):
            for x, y in zip(getattr(a, name), getattr(b, name)):
                np.testing.assert_array_equal(np.asarray(x, np.float32)[mask], np.asarray(y, np.float32)[mask])
    jaxkv.check(b)


def test_write_frames_refuses_what_does_not_fit(rng):
    spec = frame.FrameSpec(**SMALL)
    state = frame.begin_frame(frame.init(spec))
    k, v = rand_frame(rng, spec, per_layer=True)
    with pytest.raises(ValueError, match=r"layer: expected an int"):
        frame.write_frames(state, 2, k, v, 0)
    with pytest.raises(ValueError, match=r"k: expected float32\[1, S \* 7, 2, 8\]"):
        frame.write_frames(state, 0, k[:, 1:], v, 0)
    bad = k.at[0, 3, 1, 0].set(jnp.inf)
    out = frame.write_frames(state, 0, bad, v, 0)
    assert int(out.error[0]) & Fault.NONFINITE_KV
    np.testing.assert_array_equal(np.asarray(out.k[0])[np.asarray(frame.visible_mask(out))], 0)


def test_streams_are_independent(rng):
    spec = frame.FrameSpec(**{**SMALL, "num_streams": 3})
    state = frame.init(spec)
    models = [FrameModel(2, 3, 5, 2, 30) for _ in range(3)]
    for t in range(10):
        defer = np.array([t % 2 == 0, t % 3 == 0, False])
        state = frame.append(state, *rand_frame(rng, spec), defer=jnp.asarray(defer))
        for m, d in zip(models, defer):
            m.append(bool(d))
        keep = np.array([t % 4 == 0, True, True])
        state = frame.resolve(state, jnp.asarray(keep))
        for b, m in enumerate(models):
            if defer[b] or keep[b]:
                m.resolve(bool(keep[b]))
        for b, m in enumerate(models):
            assert visible(state, b) == m.visible_ids()
    # stream 0 rolled back with nothing pending on odd steps: only its own bit is set
    assert int(state.error[0]) == Fault.ROLLBACK_NOTHING_PENDING
    assert int(state.error[1]) == 0 and int(state.error[2]) == 0


def test_jitted_loop_of_100_frames_has_no_host_sync(rng):
    """100 frames of append + attention inside one jitted loop, and step by step under a transfer guard."""
    spec = frame.FrameSpec(**{**SMALL, "max_frames": 128})
    keys = jnp.asarray(rng.standard_normal((100, spec.num_layers, 1, 7, 2, 8)), jnp.float32)
    qs = jnp.asarray(rng.standard_normal((100, 1, 7, 2, 8)), jnp.float32)

    def step(state, xs):
        k, q, t = xs
        state = frame.append(state, k, -k, defer=t % 5 == 4)
        out = sum(frame.attention(state, layer, q, impl="xla") for layer in range(spec.num_layers))
        state = frame.resolve(state, t % 10 != 9)
        return state, out

    run = jax.jit(lambda s: jax.lax.scan(step, s, (keys, qs, jnp.arange(100))))
    state, outs = run(frame.init(spec))
    jaxkv.check(state)
    assert int(state.num_frames[0]) == 90 and np.all(np.isfinite(np.asarray(outs)))

    step_jit = jax.jit(step, donate_argnums=0)
    state2 = frame.init(spec)
    inputs = [(keys[t], qs[t], jnp.int32(t)) for t in range(100)]  # on device before the loop
    with jax.transfer_guard("disallow"):  # any host<->device transfer in a step raises
        for xs in inputs:
            state2, out = step_jit(state2, xs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(outs[-1]), rtol=1e-5, atol=1e-5)
    assert visible(state2) == visible(state)


def _control_flow(lowered) -> int:
    return len(re.findall(r"stablehlo\.(while|case|if)\b", lowered.as_text()))


@pytest.mark.parametrize("pow2", [False, True])
def test_branch_free_step_equals_branching_step(rng, monkeypatch, pow2):
    """Where control flow syncs with the host (XLA GPU), a frame step has none: the row
    moves always run (to the trash) and the attention of one query is one masked pass.
    Forced either way on any platform, the branch-free step gives the branching step's
    visible rows and attention, through scale frames, window turnover, deferrals and rollbacks."""
    spec = frame.FrameSpec(**{**SMALL, "num_streams": 2, "max_frames": 40, "pow2_pages": pow2})
    T = 30
    k = jnp.asarray(rng.standard_normal((T, spec.num_layers, 2, spec.tokens_per_frame, 2, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((T, 2, 1, 4, 8)), jnp.float32)  # one token, GQA group 2
    defer = jnp.asarray(rng.random((T, 2)) < 0.4)
    keep = jnp.asarray(rng.random((T, 2)) < 0.5)

    def step(state, xs):
        k, q, d, kp = xs
        state = frame.append(state, k, 0.5 * k, defer=d)
        out = jnp.stack([frame.attention(state, layer, q, impl="xla") for layer in range(spec.num_layers)])
        return frame.resolve(state, kp | ~d), out

    def run():
        jax.clear_caches()  # the flag is read when tracing
        jitted = jax.jit(step)
        state, outs = frame.init(spec), []
        for t in range(T):
            state, out = jitted(state, (k[t], q[t], defer[t], keep[t]))
            outs.append(out)
        return state, np.stack(outs), _control_flow(jitted.lower(state, (k[0], q[0], defer[0], keep[0])))

    monkeypatch.setattr(frame_tuning, "SYNCING_CONTROL_FLOW", ())  # on a GPU the default is branch-free
    branching, outs_b, flow_b = run()
    monkeypatch.setattr(frame_tuning, "SYNCING_CONTROL_FLOW", (jax.devices()[0].platform,))
    branch_free, outs_f, flow_f = run()
    jax.clear_caches()
    assert flow_b > 0 and flow_f == 0
    jaxkv.check(branch_free)
    for b in range(2):
        assert visible(branch_free, b) == visible(branching, b)
    np.testing.assert_allclose(outs_f, outs_b, rtol=2e-5, atol=2e-5)


def test_eager_cache_grows_and_raises(rng):
    cache = frame.FrameCache(**{**SMALL, "max_frames": 2})
    for _ in range(5):
        cache.append(*rand_frame(rng, cache.spec))
    assert cache.spec.max_frames >= 5 and int(cache.num_frames[0]) == 5
    with pytest.raises(CacheError, match="nothing to roll back"):
        cache.rollback()
    strict = frame.FrameCache(**{**SMALL, "max_frames": 1}, special_overflow="error")
    strict.append(*rand_frame(rng, strict.spec))
    with pytest.raises(CacheError, match="capacity"):
        strict.append(*rand_frame(rng, strict.spec))


def test_memory_target_after_1000_frames():
    """Patch memory is constant in stream length; at 1,000 frames the cache is within 5% of
    (8 + 64 + 1) frames of patches + 1,000 x 6 specials, for 24 layers (518x378)."""
    spec = frame.FrameSpec(num_layers=24, num_heads=16, head_dim=64, patches_per_frame=999, max_frames=1000)
    per_token = 2 * 24 * 16 * 64 * 2  # K+V bytes per row over all layers
    target = ((8 + 64 + 1) * 999 + 1000 * 6) * per_token
    assert abs(spec.kv_bytes - target) / target < 0.05
    # growing the stream only adds special rows (up to one page of rounding)
    small = spec.with_max_frames(100)
    extra = spec.kv_bytes - small.kv_bytes - 900 * 6 * per_token
    assert abs(extra) < spec.page_size * per_token


def test_prefix_kernel_input_checks():
    """The kernel's argument checks run on any machine (trace time); its split rule is
    ``kernels.launch.prefix_splits`` (tests/kernels/test_launch.py)."""
    from jaxkv.kernels import prefix_attention

    q = jnp.ones((1, 10, 4, 64), jnp.bfloat16)
    kv = jnp.ones((1, 512, 2, 64), jnp.bfloat16)
    n = jnp.array([5], jnp.int32)
    with pytest.raises(ValueError, match=r"kv_len: expected int32\[1\], got int32\[2\]"):
        prefix_attention(q, kv, kv, jnp.array([5, 6], jnp.int32))
    with pytest.raises(ValueError, match="expected one dtype, bfloat16 or float16"):
        prefix_attention(q.astype(jnp.float32), kv.astype(jnp.float32), kv.astype(jnp.float32), n)
    with pytest.raises(ValueError, match="splits: 512 key rows do not split into 3 chunks"):
        prefix_attention(q, kv, kv, n, splits=3)
    with pytest.raises(ValueError, match="head_dim a multiple of 64"):
        prefix_attention(q[..., :32], kv[..., :32], kv[..., :32], n)

"""Random operation sequences against the seed model, with attention recomputed from scratch."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import machine_settings
from frame_model import FrameModel
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv import frame
from jaxkv.errors import Fault

B = 2


def dense_attention(q, keys, values):
    """float64 softmax attention of q [Tq, H, D] over keys/values [N, H, D]."""
    if len(keys) == 0:
        return np.zeros_like(q)
    logits = np.einsum("qhd,khd->hqk", q, keys) / np.sqrt(q.shape[-1])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, values)


class FrameCacheMachine(RuleBasedStateMachine):
    # A few fixed shapes (each compiles once): (S, W, P, NS, max_frames, pow2)
    @initialize(
        cfg=st.sampled_from(
            [
                (2, 3, 3, 2, 9, False),  # the common case, capacity faults reachable
                (0, 2, 1, 1, 6, False),  # no scale frames, one-row patches
                (3, 0, 3, 2, 7, True),  # no window at all; power-of-two pages with padding
                (1, 1, 5, 0, 4, True),  # no specials
            ]
        )
    )
    def setup(self, cfg):
        S, W, P, NS, max_frames, pow2 = cfg
        self.spec = frame.FrameSpec(
            num_layers=2,
            num_heads=2,
            head_dim=4,
            patches_per_frame=P,
            num_special=NS,
            scale_frames=S,
            sliding_window=W,
            max_frames=max_frames,
            num_streams=B,
            dtype="float32",
            pow2_pages=pow2,
        )
        self.state = frame.init(self.spec)
        self.models = [FrameModel(S, W, P, NS, max_frames) for _ in range(B)]
        self.kv = [dict() for _ in range(B)]  # token id -> (k [L,H,D], v [L,H,D]) of every append ever
        self.rng = np.random.default_rng(0)
        self.expected_error = np.zeros(B, np.uint32)

    def _snapshot(self):
        return jax.tree.map(np.asarray, self.state)

    @rule(defer=st.lists(st.booleans(), min_size=B, max_size=B), per_layer=st.booleans())
    def append(self, defer, per_layer):
        s = self.spec
        shape = (s.num_layers, B, s.tokens_per_frame, s.num_heads, s.head_dim)
        k = self.rng.standard_normal(shape).astype(np.float32)
        v = self.rng.standard_normal(shape).astype(np.float32)
        before = self._snapshot()
        if per_layer:
            self.state = frame.begin_frame(self.state, jnp.asarray(defer))
            for layer in range(s.num_layers):
                self.state = frame.write_layer(self.state, layer, jnp.asarray(k[layer]), jnp.asarray(v[layer]))
        else:
            self.state = frame.append(self.state, jnp.asarray(k), jnp.asarray(v), jnp.asarray(defer))
        for b, m in enumerate(self.models):
            frame_idx = m.count
            was_pending = m.pending
            full = (len(m.specials) + 1) * m.NS > m.max_frames * m.NS
            if m.append(defer[b]):
                for j in range(s.tokens_per_frame):
                    self.kv[b][frame_idx * s.tokens_per_frame + j] = (k[:, b, j], v[:, b, j])
            else:
                self.expected_error[b] |= (Fault.APPEND_WHILE_PENDING if was_pending else 0) | (
                    Fault.SPECIAL_CAPACITY if full else 0
                )
                self._assert_stream_unchanged(before, b)

    @rule(keep=st.lists(st.booleans(), min_size=B, max_size=B))
    def resolve(self, keep):
        before = self._snapshot()
        self.state = frame.resolve(self.state, jnp.asarray(keep))
        for b, m in enumerate(self.models):
            if not m.resolve(keep[b]):
                self.expected_error[b] |= Fault.ROLLBACK_NOTHING_PENDING
                self._assert_stream_unchanged(before, b)

    @precondition(lambda self: self.rng.random() < 0.2)
    @rule()
    def reset(self):
        self.state = frame.reset(self.state)
        for m in self.models:
            m.reset()
        self.expected_error[:] = 0

    def _assert_stream_unchanged(self, before, b):
        after = self._snapshot()
        mask = np.asarray(frame.visible_mask(before))[b]
        for name in ("num_frames", "num_scale", "num_window", "window_head", "num_special", "pending"):
            assert getattr(after, name)[b] == getattr(before, name)[b], name
        np.testing.assert_array_equal(np.stack(after.k)[:, b][:, mask], np.stack(before.k)[:, b][:, mask])
        np.testing.assert_array_equal(after.token_id[b][mask], before.token_id[b][mask])

    @invariant()
    def matches_model(self):
        if not hasattr(self, "state"):
            return
        ids = np.asarray(frame.visible_token_ids(self.state))
        mask = np.asarray(frame.visible_mask(self.state))
        for b, m in enumerate(self.models):
            got = ids[b][ids[b] >= 0]
            assert sorted(got.tolist()) == m.visible_ids()
            assert len(set(got.tolist())) == len(got)  # no token in two places
            # stored K/V of every visible row are the ones appended for that token
            rows = np.nonzero(mask[b])[0]
            for r in rows[:: max(1, len(rows) // 7)]:
                kk, vv = self.kv[b][int(ids[b, r])]
                np.testing.assert_array_equal(np.stack([x[b, r] for x in self.state.k]), kk)
                np.testing.assert_array_equal(np.stack([x[b, r] for x in self.state.v]), vv)
        np.testing.assert_array_equal(np.asarray(self.state.error), self.expected_error)
        pt = frame.page_table(self.state)
        for b in range(B):
            n = int(pt.num_pages[b])
            pages = np.asarray(pt.indices[b, :n])
            assert len(set(pages.tolist())) == n

    @invariant()
    def attention_equals_dense(self):
        if not hasattr(self, "state"):
            return
        s = self.spec
        q = self.rng.standard_normal((B, 3, s.num_heads, s.head_dim)).astype(np.float32)
        for layer in range(s.num_layers):
            outs = {
                impl: np.asarray(frame.attention(self.state, layer, jnp.asarray(q), impl=impl))
                for impl in ("reference", "xla")
            }
            for b, m in enumerate(self.models):
                ids = m.visible_ids()
                keys = np.array([self.kv[b][i][0][layer] for i in ids], np.float64).reshape(-1, s.num_heads, s.head_dim)
                vals = np.array([self.kv[b][i][1][layer] for i in ids], np.float64).reshape(-1, s.num_heads, s.head_dim)
                want = dense_attention(q[b].astype(np.float64), keys, vals)
                for impl, out in outs.items():
                    np.testing.assert_allclose(out[b], want, rtol=2e-5, atol=2e-5, err_msg=impl)


TestFrameCache = FrameCacheMachine.TestCase
TestFrameCache.settings = machine_settings(examples=10, steps=20)

"""Hypothesis: random batches of ragged steps through the hybrid cache's whole per-step path
(prepare_forward, the SWA window, CSA / HCA compress and flush, indexer top-k, gather,
attention), with requests finishing and their slots reused, requests swapped to host
memory and back into another empty slot (``offload`` / ``reload``), and new requests
started from a prefix of another (``share``, the re-feed, ``complete_share``).

Checked after every step: nothing faults; each request's position; every block either on
the free stack once or named by at least one block table, never both, none lost. When a
request finishes: its compressed entries and indexer keys,
read through its block table, equal those of the same tokens fed alone to a fresh cache,
byte for byte (its neighbours, its chunking and its slot changed nothing).
"""

from __future__ import annotations

import hybrid_driver as D
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import machine_settings
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import jaxkv
from jaxkv import hybrid as H

CFG = H.HybridConfig(
    compress_ratios=(0, 4, 8), window=8, index_heads=2, top_k=4, block_size=2, max_requests=3, max_context=48
)
CHUNK = 6
R = CFG.max_requests
PARAMS = D.make_params(CFG, np.random.default_rng(0))


def _feed(state, slot, tokens, lo, hi):
    """Positions ``lo .. hi - 1`` of ``tokens`` (one request's history) into ``slot``, CHUNK at a time."""
    for t0 in range(lo, hi, CHUNK):
        k = min(CHUNK, hi - t0)
        x = {l: {key: _pad(a[:, t0 : t0 + k]) for key, a in xl.items()} for l, xl in tokens.items()}
        state, step = H.prepare_forward(state, jnp.array([slot]), jnp.array([t0]), jnp.array([k]), chunk=CHUNK)
        state, _, _ = D.model_step(state, step, x, PARAMS)
    return state


def _replay_alone(tokens):
    """The request's tokens fed alone to a fresh cache -> its state (slot 0)."""
    state = _feed(H.init(CFG), 0, tokens, 0, next(iter(tokens[0].values())).shape[1])
    jaxkv.check(state)
    return state


def _pad(a):
    return jnp.concatenate([a, jnp.full((a.shape[0], CHUNK - a.shape[1]) + a.shape[2:], 3.0, a.dtype)], axis=1)


class HybridMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = H.init(CFG)
        self.pos = [0] * R
        self.tokens = [None] * R  # per slot: {layer: {key: [1, pos, ...]}} of its history
        self.seed = 0

    @rule(counts=st.lists(st.integers(0, CHUNK), min_size=R, max_size=R))
    def step(self, counts):
        counts = [n if self.pos[s] + n <= CFG.max_context else 0 for s, n in enumerate(counts)]
        self.seed += 1
        x = D.make_inputs(CFG, np.random.default_rng(self.seed), R, CHUNK)
        self.state, step = H.prepare_forward(
            self.state, jnp.arange(R), jnp.asarray(self.pos), jnp.asarray(counts), chunk=CHUNK
        )
        self.state, _, _ = D.model_step(self.state, step, x, PARAMS)
        jaxkv.check(self.state)  # the pool holds every request's whole context: no fault
        for s, n in enumerate(counts):
            if n:
                new = {l: {k: a[s : s + 1, :n] for k, a in xl.items()} for l, xl in x.items()}
                old = self.tokens[s]
                self.tokens[s] = (
                    new
                    if old is None
                    else {l: {k: jnp.concatenate([old[l][k], new[l][k]], axis=1) for k in new[l]} for l in new}
                )
                self.pos[s] += n

    @rule(slot=st.integers(0, R - 1))
    def finish(self, slot):
        if self.pos[slot]:
            alone = _replay_alone(self.tokens[slot])
            for layer, ratio in enumerate(CFG.compress_ratios):
                if ratio:
                    cnt = self.pos[slot] // ratio
                    np.testing.assert_array_equal(
                        D.entries_bytes(self.state, layer, slot, cnt),
                        D.entries_bytes(alone, layer, 0, cnt),
                        err_msg=f"layer {layer}",
                    )
                    if CFG.kind(layer) == H.CSA:
                        np.testing.assert_array_equal(
                            D.index_key_bytes(self.state, layer, slot, cnt), D.index_key_bytes(alone, layer, 0, cnt)
                        )
        self.state = H.finish(self.state, jnp.array([slot]))
        if self.pos[slot]:
            jaxkv.check(self.state)
        else:  # released twice (or never used): a fault, nothing else changes
            with pytest.raises(jaxkv.CacheError, match="finish of a slot that holds nothing"):
                jaxkv.check(self.state)
            self.state = jaxkv.clear_errors(self.state)
        self.pos[slot], self.tokens[slot] = 0, None

    @rule(slot=st.integers(0, R - 1), to=st.integers(0, R - 1))
    def swap(self, slot, to):
        """The request in ``slot`` to host memory and back into ``to`` if that is empty once
        it left (else back into ``slot``)."""
        self.state, image = H.offload(self.state, jnp.array([slot]))
        to = to if to == slot or self.pos[to] == 0 else slot
        self.state = H.reload(self.state, jnp.array([to]), H.to_host(image))
        jaxkv.check(self.state)
        self.pos[slot], self.pos[to] = 0, self.pos[slot]
        self.tokens[slot], self.tokens[to] = None, self.tokens[slot]

    @rule(src=st.integers(0, R - 1), dst=st.integers(0, R - 1), frac=st.floats(0.0, 1.0))
    def share(self, src, dst, frac):
        """A new request in the empty slot ``dst`` from the first tokens of ``src``."""
        if self.pos[src] == 0 or self.pos[dst] or src == dst:
            return
        length = max(1, round(frac * self.pos[src]))
        self.state = H.share(self.state, [dst], [src], [length])
        start = H.refeed_start(CFG, length, self.pos[src])
        event("share: whole source" if start == length else "share: re-fed")
        self.state = _feed(self.state, dst, self.tokens[src], start, length)
        self.state = H.complete_share(self.state, [dst], [src], [length])
        jaxkv.check(self.state)
        self.pos[dst] = length
        self.tokens[dst] = {l: {k: a[:, :length] for k, a in xl.items()} for l, xl in self.tokens[src].items()}

    @invariant()
    def blocks_free_once_or_held(self):
        for g, al in enumerate(self.state.alloc):
            held = {int(b) for s in range(R) for b in np.asarray(al.table[s])[: int(al.owned[s])]}
            free = [int(b) for b in np.asarray(al.free)[: int(al.num_free)]]
            assert len(set(free)) == len(free), (g, free)
            assert not held & set(free), (g, held, free)
            assert held | set(free) == set(range(CFG.num_blocks(CFG.ratios[g]))), (g, held, free)

    @invariant()
    def positions(self):
        np.testing.assert_array_equal(np.asarray(self.state.position), self.pos)


HybridMachine.TestCase.settings = machine_settings(examples=2, steps=12)
TestHybridCache = HybridMachine.TestCase

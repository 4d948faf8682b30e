"""Hypothesis: random batches of ragged steps through the hybrid cache's whole per-step path
(prepare_forward, the SWA window, CSA / HCA compress and flush, indexer top-k, gather,
attention), with requests finishing and their slots reused, and requests swapped to host
memory and back into another empty slot (``offload`` / ``reload``).

Checked after every step: nothing faults but a pool the model says is exhausted; each
request's position; every block either free or held by exactly one request (none lost,
none twice). When a request finishes: its compressed entries and indexer keys,
read through its block table, equal those of the same tokens fed alone to a fresh cache,
byte for byte (its neighbours, its chunking and its slot changed nothing).
"""

from __future__ import annotations

import hybrid_driver as D
import jax.numpy as jnp
import numpy as np
from conftest import machine_settings
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


def _replay_alone(tokens):
    """The request's tokens fed alone, CHUNK at a time, to a fresh cache -> its state (slot 0)."""
    state = H.init(CFG)
    n = next(iter(tokens[0].values())).shape[1]
    for t0 in range(0, n, CHUNK):
        k = min(CHUNK, n - t0)
        x = {l: {key: _pad(a[:, t0 : t0 + k]) for key, a in xl.items()} for l, xl in tokens.items()}
        state, step = H.prepare_forward(state, jnp.array([0]), jnp.array([t0]), jnp.array([k]), chunk=CHUNK)
        state, _, _ = D.model_step(state, step, x, PARAMS)
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
        jaxkv.check(self.state)
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

    @invariant()
    def blocks_held_once(self):
        for g, al in enumerate(self.state.alloc):
            held = [int(b) for s in range(R) for b in np.asarray(al.table[s])[: int(al.owned[s])]]
            free = list(np.asarray(al.free)[: int(al.num_free)])
            assert sorted(held + free) == list(range(CFG.num_blocks(CFG.ratios[g]))), (g, held, free)

    @invariant()
    def positions(self):
        np.testing.assert_array_equal(np.asarray(self.state.position), self.pos)


HybridMachine.TestCase.settings = machine_settings(examples=2, steps=12)
TestHybridCache = HybridMachine.TestCase

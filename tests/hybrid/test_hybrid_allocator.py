"""Hypothesis: random admit / step / finish against a pure-Python model of the block allocator.

After every operation, for every ratio: no block is owned twice, free + used = total,
each request holds exactly the blocks its entries need (its table's valid prefix, -1
after), positions match the model, and a refused row (pool exhausted) left its request
as it was.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from conftest import machine_settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import jaxkv
from jaxkv import hybrid as H
from jaxkv.errors import Fault

CFG = H.HybridConfig(
    compress_ratios=(0, 4, 8, 4), window=8, block_size=2, max_requests=4, max_context=64, pool_tokens=96
)
CHUNK = 12
R = CFG.max_requests


class Allocator(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = H.init(CFG)
        self.pos = [0] * R
        self.free = {r: CFG.num_blocks(r) for r in CFG.ratios}

    def blocks_for(self, r, pos):
        return math.ceil((pos // r) / CFG.block_size)

    @rule(counts=st.lists(st.integers(0, CHUNK), min_size=R, max_size=R))
    def step(self, counts):
        """All slots in one batch (a slot at position 0 is admitted by its first tokens)."""
        counts = [n if self.pos[s] + n <= CFG.max_context else 0 for s, n in enumerate(counts)]
        before_err = np.asarray(self.state.error).copy()
        self.state, step = H.prepare_forward(
            self.state, jnp.arange(R), jnp.asarray(self.pos), jnp.asarray(counts), chunk=CHUNK
        )
        # model: rows in order; a row fits if the running total of needs fits every ratio
        running = {r: 0 for r in CFG.ratios}
        want_active = []
        for s, n in enumerate(counts):
            needs = {r: self.blocks_for(r, self.pos[s] + n) - self.blocks_for(r, self.pos[s]) for r in CFG.ratios}
            for r in CFG.ratios:
                running[r] += needs[r]
            ok = all(running[r] <= self.free[r] for r in CFG.ratios)
            want_active.append(ok)
        for s, n in enumerate(counts):
            if want_active[s]:
                for r in CFG.ratios:
                    self.free[r] -= self.blocks_for(r, self.pos[s] + n) - self.blocks_for(r, self.pos[s])
                self.pos[s] += n
        assert np.asarray(step.active).tolist() == want_active
        err = np.asarray(self.state.error)
        for s, ok in enumerate(want_active):
            assert bool(err[s] & Fault.POOL_EXHAUSTED) == (not ok or bool(before_err[s] & Fault.POOL_EXHAUSTED))
        self.state = jaxkv.clear_errors(self.state)

    @rule(slot=st.integers(0, R - 1))
    def finish(self, slot):
        self.state = H.finish(self.state, jnp.array([slot]))
        for r in CFG.ratios:
            self.free[r] += self.blocks_for(r, self.pos[slot])
        if self.pos[slot] == 0:  # nothing to release: SLOT_EMPTY, and nothing else changed
            err = np.asarray(self.state.error)
            assert err[slot] & Fault.SLOT_EMPTY and not np.delete(err, slot).any()
            self.state = jaxkv.clear_errors(self.state)
        self.pos[slot] = 0
        jaxkv.check(self.state)

    @invariant()
    def books_balance(self):
        np.testing.assert_array_equal(np.asarray(self.state.position), self.pos)
        for r, al in zip(CFG.ratios, self.state.alloc):
            nb = CFG.num_blocks(r)
            table, owned = np.asarray(al.table), np.asarray(al.owned)
            num_free = int(al.num_free)
            assert num_free == self.free[r]
            free = np.asarray(al.free)[:num_free].tolist()
            used = []
            for s in range(R):
                assert owned[s] == self.blocks_for(r, self.pos[s])  # the table covers the entries, no more
                assert (table[s, : owned[s]] >= 0).all() and (table[s, owned[s] :] == -1).all()
                used += table[s, : owned[s]].tolist()
            assert len(set(used)) == len(used), "a block owned twice"
            assert sorted(free + used) == list(range(nb)), "free + used != all blocks"


Allocator.TestCase.settings = machine_settings(examples=30, steps=25)
TestAllocator = Allocator.TestCase

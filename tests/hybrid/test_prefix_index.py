"""PrefixIndex: the longest cached prefix of a prompt, against a brute-force search; LRU
eviction of retained slots; what it refuses."""

import numpy as np
import pytest

from jaxkv.hybrid import PrefixIndex


def _brute(held: dict, prompt, limit, whole=False):
    best = None
    for toks in held.values():
        n = 0
        while n < min(limit, len(toks)) and toks[n] == prompt[n]:
            n += 1
        if whole and n < len(toks):
            continue
        if n and (best is None or n > best):
            best = n
    return best


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_lookup_is_the_longest_common_prefix(chunk, rng):
    """Requests built from a few shared stems with random tails (a small vocabulary, so
    prefixes collide often): every lookup returns a slot whose tokens share exactly the
    longest prefix any indexed slot shares with the prompt, at any length."""
    idx = PrefixIndex(chunk=chunk)
    stems = [list(rng.integers(0, 3, size=int(rng.integers(0, 40)))) for _ in range(4)]
    held = {}
    for slot in range(12):
        toks = stems[slot % 4] + list(rng.integers(0, 3, size=int(rng.integers(1, 30))))
        idx.add(slot, toks[:5])
        idx.extend(slot, toks[5:])
        held[slot] = toks
    for _ in range(200):
        prompt = stems[int(rng.integers(0, 4))] + list(rng.integers(0, 3, size=int(rng.integers(1, 40))))
        for whole in (False, True):
            got = idx.lookup(prompt, whole=whole)
            want = _brute(held, prompt, len(prompt) - 1, whole)
            if want is None:
                assert got is None
                continue
            slot, n = got
            assert n == want and held[slot][:n] == prompt[:n]
            assert not whole or n == len(held[slot])
    assert idx.hits <= idx.lookups == 400


def test_retained_slots_are_evicted_least_recently_used_first():
    idx = PrefixIndex(chunk=2, capacity=2)
    for slot in range(3):
        idx.add(slot, [slot] * 6)
    assert idx.retain(0) == [] and idx.retain(1) == []
    assert idx.lookup([0] * 7) == (0, 6)  # 0 is now the most recently used
    assert idx.retain(2) == [1]  # over capacity: the least recently used goes
    assert 1 not in idx and idx.lookup([1] * 7) is None  # an evicted prefix is never returned
    assert idx.retained == [0, 2]
    assert idx.evict() == 0 and idx.evict() == 2 and idx.evict() is None
    idx.add(0, [5, 5])  # the slot is free for a new request
    assert idx.lookup([5, 5, 5]) == (0, 2)


def test_index_refusals():
    with pytest.raises(ValueError, match="chunk: expected a positive int, got 0"):
        PrefixIndex(chunk=0)
    with pytest.raises(ValueError, match="capacity: expected None or an int >= 0, got -1"):
        PrefixIndex(capacity=-1)
    idx = PrefixIndex(chunk=2)
    idx.add(0, [1, 2, 3])
    with pytest.raises(ValueError, match="slot: 0 is already indexed"):
        idx.add(0, [1])
    with pytest.raises(KeyError, match="slot: 7 is not indexed"):
        idx.extend(7, [1])
    idx.retain(0)
    with pytest.raises(ValueError, match="slot: 0 is retained"):
        idx.extend(0, [4])
    assert idx.lookup(np.array([1, 2, 3, 4])) == (0, 3)

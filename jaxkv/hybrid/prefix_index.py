"""PrefixIndex: which cached request holds the longest prefix of a prompt (host side).

The device cache knows blocks, not tokens; a server knows tokens. This index maps a prompt
to the slot whose tokens share the longest prefix with it, for ``hybrid.share``. It keeps
every indexed slot's tokens, and a hash of each ``chunk``-token prefix, so a lookup walks
the prompt's chunks through a dict and then compares tokens one by one past the last full
chunk: a hit may end at any token, and a hash collision can never give a wrong prefix.

A slot is *live* (its request is still running; ``add`` / ``extend`` as it grows) or
*retained* (finished, kept as a prefix cache: ``retain``). Retained slots are evicted least
recently used first: past ``capacity`` (``retain`` returns the slots to free), or when the
caller needs blocks or slots (``evict``). The caller frees an evicted slot on the device
(``hybrid.finish``); the index forgets it at once, so it never returns an evicted prefix.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


class PrefixIndex:
    """Longest cached prefix of a prompt, over the slots the caller indexes.

    Args:
      chunk: tokens per hashed prefix step (a lookup costs one dict probe per chunk).
      capacity: most retained slots kept (None: no bound; ``evict`` still frees them).
    """

    def __init__(self, chunk: int = 64, capacity: int | None = None):
        if chunk < 1:
            raise ValueError(f"chunk: expected a positive int, got {chunk}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity: expected None or an int >= 0, got {capacity}")
        self.chunk, self.capacity = chunk, capacity
        self._tokens: dict[int, list[int]] = {}
        self._keys: dict[int, list[int]] = {}  # slot -> hash of each full chunk prefix
        self._holders: dict[int, set[int]] = collections.defaultdict(set)  # hash -> slots
        self._retained: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.lookups = self.hits = self.hit_tokens = self.prompt_tokens = 0

    # ---------------------------------------------------------------- what the cache holds
    def add(self, slot: int, tokens: Sequence[int]) -> None:
        """Index ``slot`` as holding ``tokens`` (a new request, or one reloaded into it)."""
        if slot in self._tokens:
            raise ValueError(f"slot: {slot} is already indexed (release it first)")
        self._tokens[slot], self._keys[slot] = [], []
        self.extend(slot, tokens)

    def extend(self, slot: int, tokens: Sequence[int]) -> None:
        """``slot``'s request has taken ``tokens`` more."""
        if slot not in self._tokens:
            raise KeyError(f"slot: {slot} is not indexed (add it first)")
        if slot in self._retained:
            raise ValueError(f"slot: {slot} is retained (finished); a retained prefix does not grow")
        have, keys = self._tokens[slot], self._keys[slot]
        have.extend(int(t) for t in tokens)
        while len(keys) * self.chunk + self.chunk <= len(have):
            k = len(keys)
            h = hash((keys[-1] if keys else 0, tuple(have[k * self.chunk : (k + 1) * self.chunk])))
            keys.append(h)
            self._holders[h].add(slot)

    def retain(self, slot: int) -> list[int]:
        """``slot``'s request finished; keep it as a prefix cache. Returns the retained slots
        evicted to stay within ``capacity`` (free them with ``hybrid.finish``)."""
        if slot not in self._tokens:
            raise KeyError(f"slot: {slot} is not indexed")
        self._retained[slot] = None
        out = []
        while self.capacity is not None and len(self._retained) > self.capacity:
            out.append(self.evict())
        return out

    def evict(self) -> int | None:
        """The least recently used retained slot, forgotten (None if none is retained): the
        caller frees it on the device (``hybrid.finish``)."""
        if not self._retained:
            return None
        slot, _ = self._retained.popitem(last=False)
        self.release(slot)
        return slot

    def release(self, slot: int) -> None:
        """Forget ``slot`` (finished without retaining, evicted, or offloaded)."""
        for h in self._keys.pop(slot, ()):
            self._holders[h].discard(slot)
            if not self._holders[h]:
                del self._holders[h]
        self._tokens.pop(slot, None)
        self._retained.pop(slot, None)

    # ---------------------------------------------------------------- lookups
    def lookup(self, prompt: Sequence[int], *, limit: int | None = None, whole: bool = False) -> tuple[int, int] | None:
        """(slot, length): the indexed slot sharing the longest prefix with ``prompt`` and that
        prefix's length (at most ``limit``, default ``len(prompt) - 1``: the last prompt token
        is fed, so the step has a query), or None. Among equal lengths, a slot whose whole
        request matches comes first (``share`` then copies its ring and tails: nothing to
        re-feed). ``whole``: only such slots (a model that cannot re-feed exactly, see
        ``hybrid.share``). A hit marks a retained slot as recently used."""
        prompt = [int(t) for t in prompt]
        limit = len(prompt) - 1 if limit is None else min(limit, len(prompt))
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        levels = []  # (k, slots whose first k chunks hash as the prompt's, and no more)
        cands, prev, k = set(self._tokens), 0, 0
        while (k + 1) * self.chunk <= limit:
            h = hash((prev, tuple(prompt[k * self.chunk : (k + 1) * self.chunk])))
            nxt = cands & self._holders.get(h, set())
            if not nxt:
                break
            levels.append((k, cands - nxt))
            cands, prev, k = nxt, h, k + 1
        levels.append((k, cands))
        best = None
        for k, slots in levels:
            m = k * self.chunk
            for slot in slots:
                toks = self._tokens[slot]
                if toks[:m] != prompt[:m]:  # a hash collision: not a prefix after all
                    continue
                n, stop = m, min(limit, len(toks))
                while n < stop and toks[n] == prompt[n]:
                    n += 1
                key = (n, n == len(toks), slot in self._retained)
                if n and (not whole or n == len(toks)) and (best is None or key > best[0]):
                    best = (key, slot)
        if best is None:
            return None
        (n, _, _), slot = best
        if slot in self._retained:
            self._retained.move_to_end(slot)
        self.hits += 1
        self.hit_tokens += n
        return slot, n

    def tokens(self, slot: int) -> list[int]:
        """The tokens ``slot`` holds (a copy)."""
        return list(self._tokens[slot])

    @property
    def retained(self) -> list[int]:
        """Retained slots, least recently used first."""
        return list(self._retained)

    def __contains__(self, slot: int) -> bool:
        return slot in self._tokens

    def __repr__(self) -> str:
        return (
            f"PrefixIndex(chunk={self.chunk}, capacity={self.capacity}, slots={len(self._tokens)}, "
            f"retained={len(self._retained)}, hits={self.hits}/{self.lookups})"
        )


__all__ = ["PrefixIndex"]

"""A small pure-Python model of the frame cache semantics of lingbot-map's manager (one stream): the
tests' oracle for what is visible after any sequence of appends, commits and rollbacks."""

from __future__ import annotations

import collections


class FrameModel:
    def __init__(self, S, W, P, NS, max_frames):
        self.S, self.W, self.P, self.NS, self.max_frames = S, W, P, NS, max_frames
        self.reset()

    @property
    def tpf(self):
        return self.P + self.NS

    def reset(self):
        self.scale, self.window, self.specials = [], collections.deque(), []
        self.count, self.pending = 0, False

    def append(self, defer: bool) -> bool:
        """Returns whether the append was accepted (a fault leaves everything unchanged)."""
        if self.pending or (len(self.specials) + 1) * self.NS > self.max_frames * self.NS:
            return False
        f = self.count
        self.count += 1
        (self.scale if len(self.scale) < self.S else self.window).append(f)
        self.specials.append(f)
        self.pending = defer
        if not defer:
            self._evict()
        return True

    def _evict(self):
        while len(self.window) > self.W:
            self.window.popleft()

    def resolve(self, keep: bool) -> bool:
        if keep:
            self._evict()
            self.pending = False
            return True
        if not self.pending:
            return False
        if self.count > self.S:
            self.window.pop()
        else:
            self.scale.pop()
        self.specials.pop()
        self.count -= 1
        self.pending = False
        return True

    def visible_ids(self):
        ids = []
        for f in list(self.scale) + list(self.window):
            ids += [f * self.tpf + self.NS + j for j in range(self.P)]
        for f in self.specials:
            ids += [f * self.tpf + j for j in range(self.NS)]
        return sorted(ids)

"""FrameCache: a stateful, eager wrapper for notebooks and scripts.

It holds a ``FrameCacheState``, calls the jitted functions, raises ``CacheError`` as
soon as an operation records a fault (``check=True``; each check is a host sync, so a
hot loop should use the functional API inside ``jit`` and call ``jaxkv.check`` now and
then), and grows the special capacity when it would run out (``special_overflow="grow"``).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.errors import check as _check
from jaxkv.frame import attention as _attn
from jaxkv.frame import ops, views
from jaxkv.frame import state as _state
from jaxkv.frame.spec import FrameSpec


class FrameCache:
    def __init__(
        self, spec: FrameSpec | None = None, *, special_overflow: str = "grow", check: bool = True, **spec_kwargs
    ):
        if spec is None:
            spec = FrameSpec(**spec_kwargs)
        elif spec_kwargs:
            raise ValueError(
                f"spec_kwargs: give a FrameSpec or keyword arguments, not both (got {sorted(spec_kwargs)})"
            )
        if special_overflow not in ("grow", "error"):
            raise ValueError(f"special_overflow: expected 'grow' or 'error', got {special_overflow!r}")
        self.special_overflow = special_overflow
        self.checks = check
        self.state = _state.init(spec)
        self._specials_bound = 0  # host-side upper bound of num_special, to grow without a sync

    @property
    def spec(self) -> FrameSpec:
        return self.state.spec

    def _done(self, new_state):
        self.state = new_state
        if self.checks:
            _check(new_state)
        return self

    def _make_room(self):
        s = self.spec
        if self._specials_bound + s.num_special <= s.special_capacity:
            return
        self._specials_bound = int(np.max(np.asarray(self.state.num_special)))
        if self.special_overflow == "grow" and self._specials_bound + s.num_special > s.special_capacity:
            self.state = _state.grow(self.state, 2 * s.max_frames)

    def begin_frame(self, defer=False):
        self._make_room()
        self._specials_bound += self.spec.num_special
        return self._done(ops.begin_frame(self.state, defer))

    def write_layer(self, layer: int, k, v):
        return self._done(ops.write_layer(self.state, layer, k, v))

    def append(self, k, v, defer=False):
        """k, v: [L, B, tokens_per_frame, H, D]."""
        self._make_room()
        self._specials_bound += self.spec.num_special
        return self._done(ops.append(self.state, k, v, defer))

    def resolve(self, keep):
        return self._done(ops.resolve(self.state, keep))

    def commit(self):
        return self.resolve(True)

    def rollback(self):
        return self.resolve(False)

    def reset(self):
        self._specials_bound = 0
        return self._done(_state.reset(self.state))

    def attention(self, layer, q, impl: str = "auto"):
        return _attn.attention(self.state, layer, q, impl=impl)

    def page_table(self) -> views.PageTable:
        return views.page_table(self.state)

    def visible_token_ids(self):
        return views.visible_token_ids(self.state)

    @property
    def num_frames(self) -> np.ndarray:
        return np.asarray(self.state.num_frames)

    @property
    def nbytes(self) -> int:
        """Device bytes of the whole state."""
        return int(sum(x.nbytes for x in jax.tree.leaves(self.state)))

    def __repr__(self):
        s = self.spec
        return (
            f"FrameCache(layers={s.num_layers}, streams={s.num_streams}, heads={s.num_heads}, "
            f"head_dim={s.head_dim}, P={s.patches_per_frame}+{s.num_special}, S={s.scale_frames}, "
            f"W={s.sliding_window}, max_frames={s.max_frames}, {self.nbytes / 2**20:.1f} MiB)"
        )

"""Stacked: a layer's input given as one row of an array stacked over layers.

A model that keeps a kind of layer's weights (or a step's activations) stacked as
``array[n, ...]`` passes ``Stacked(array, i)`` wherever a layer op takes ``array[i]``.
The fused kernels read row ``i`` in place; a slice would be a device copy per operand
(a custom call's operand is its own buffer), and passing the rows as separate arguments
costs the jitted call host time per argument (docs/design.md).
Paths without a kernel slice the row, which XLA fuses into its consumers.

``shape``, ``ndim`` and ``dtype`` are the row's, so validators read a ``Stacked`` like
the array it stands for.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxkv._pytree import cache_dataclass, static_field


@cache_dataclass
class Stacked:
    """Row ``index`` (a static int) of ``array`` (``[n, ...]``)."""

    array: jnp.ndarray
    index: int = static_field()

    @property
    def shape(self):
        return tuple(self.array.shape[1:])

    @property
    def ndim(self):
        return self.array.ndim - 1

    @property
    def dtype(self):
        return self.array.dtype


def check_stacked(name: str, x) -> None:
    """ValueError unless ``x`` is an array or a ``Stacked`` whose index is in range."""
    if isinstance(x, Stacked):
        n = x.array.shape[0] if x.array.ndim else 0
        if not isinstance(x.index, int) or not 0 <= x.index < n:
            raise ValueError(
                f"{name}: expected Stacked.index a static int in [0, {n}) (the array's leading axis), "
                f"got {x.index!r} for an array of shape {tuple(x.array.shape)}"
            )


def row(x):
    """The array ``x`` stands for (``array[index]`` of a ``Stacked``)."""
    return x.array[x.index] if isinstance(x, Stacked) else x


def as_stack(x, dtype=None):
    """``(stack[n, ...], index)`` with ``stack[index]`` the array ``x`` stands for: a
    ``Stacked``'s own array, or ``x[None], 0``. ``dtype``: cast (a copy only if it differs)."""
    stack, index = (x.array, x.index) if isinstance(x, Stacked) else (x[None], 0)
    return (stack if dtype is None else stack.astype(dtype)), index


def as_flat(x, dtype=None):
    """``(flat, offset)``: ``as_stack``'s whole stack flattened, and the element where the
    row ``x`` stands for starts (what a kernel that reads the row in place takes)."""
    stack, index = as_stack(x, dtype)
    return stack.reshape(-1), index * math.prod(stack.shape[1:])


def map_stack(fn, x):
    """Apply ``fn`` to the whole stack, keeping the row: ``fn`` maps ``[n, ...]`` to
    ``[n, ...]`` row by row (a reshape of the trailing axes, a cast)."""
    if isinstance(x, Stacked):
        return Stacked(fn(x.array), x.index)
    return fn(x[None])[0]


__all__ = ["Stacked", "as_flat", "as_stack", "check_stacked", "map_stack", "row"]

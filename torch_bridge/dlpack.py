"""Zero-copy views between jax arrays and torch tensors (DLPack).

Rules:
* A view shares memory: ``to_torch(x)`` and ``x`` are one buffer (same device pointer).
  JAX owns the buffers it allocated (every jaxkv state); torch owns its own.
* Never donate, to a jitted jaxkv update, an array that a live torch view still
  references: JAX refuses ("Donation requested for buffer with external reference").
  Drop the torch view (``del t``) before the next donated update, or take a new view
  after it — the updated state is a new array.
* FP8 crosses as FP8 where both sides know the DLPack code (jax >= 0.5, torch >= 2.4);
  FP4 never crosses unpacked: jaxkv stores it as packed uint8 bytes.
* Ordering: DLPack export makes the consumer's stream wait for the producer's pending
  work, so a JAX update is visible to torch work issued after ``to_torch`` and a torch
  write is visible to JAX work issued after ``from_torch``.
* Lifetime: JAX frees (or, donated, reuses) a buffer as soon as nothing references it,
  whatever torch's stream has yet to run on it; wait for torch's stream before the last
  view of a JAX buffer goes.
"""

from __future__ import annotations

import jax


def to_torch(x: jax.Array):
    """A torch tensor sharing ``x``'s memory."""
    import torch

    if not isinstance(x, jax.Array):
        raise ValueError(f"x: expected a jax.Array, got {type(x).__name__}")
    return torch.from_dlpack(x)


def from_torch(t) -> jax.Array:
    """A jax array sharing ``t``'s memory (``t`` must be contiguous)."""
    if not t.is_contiguous():
        raise ValueError(f"t: expected a contiguous tensor, got strides {tuple(t.stride())} for shape {tuple(t.shape)}")
    return jax.dlpack.from_dlpack(t)

"""Registering cache states as pytrees (and as Flax NNX data, where Flax is installed)."""

from __future__ import annotations

import dataclasses

import jax


def cache_dataclass(cls):
    """Frozen dataclass whose ``static`` fields (metadata={"static": True}) are pytree aux data."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    data, meta = [], []
    for f in dataclasses.fields(cls):
        (meta if f.metadata.get("static") else data).append(f.name)
    jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
    cls.replace = lambda self, **kw: dataclasses.replace(self, **kw)
    try:  # let an nnx.Module hold a cache state as an attribute
        from flax import nnx
    except ImportError:  # flax is optional
        return cls
    if hasattr(nnx, "register_data_type"):
        nnx.register_data_type(cls)
    return cls


def static_field(**kw):
    return dataclasses.field(metadata={"static": True}, **kw)

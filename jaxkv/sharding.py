"""Sharding by logical axes: the one table from a cache's axes to a mesh's axes.

Every array of a cache names its axes with the logical names below; a ``Layout`` (a
``jax.sharding.Mesh`` and the rules) turns them into ``PartitionSpec`` s. A state made
with ``frame.init(spec, mesh=...)`` / ``hybrid.init(config, mesh=...)`` carries its
``Layout`` as a static field, and every per-step operation runs its unchanged
single-device code on each device's part of the state under ``jax.shard_map``
(``on_devices``): what a device computes is what one device computes for its streams or
requests, so a step compiles with no collective (``tests/sharding``).

| logical axis | what it is | default mesh axis |
| --- | --- | --- |
| ``streams`` | frame cache: video streams (``FrameSpec.num_streams``), a step's batch | ``data`` |
| ``requests`` | hybrid cache: request slots (``max_requests``), a step's batch rows; the pools' blocks, the block tables and the free stacks split with them, so each device owns its requests' blocks | ``data`` |
| ``heads`` | frame cache KV heads and the query heads attending to them | ``model`` |

Every other axis (layers, tokens, rows, bytes, the hybrid indexer's heads: its score sums
over heads, which sharded would need an all-reduce) is replicated. A rule naming a mesh
axis the mesh lacks leaves that logical axis replicated, so the same rules serve a 1-D
``("data",)`` mesh and a 2-D ``("data", "model")`` one.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("streams", "requests", "heads")
DEFAULT_RULES = (("streams", "data"), ("requests", "data"), ("heads", "model"))

try:  # jax >= 0.6 (0.10, 0.11)
    _shard_map = jax.shard_map
    _NO_CHECK = dict(check_vma=False)
except AttributeError:  # older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = dict(check_rep=False)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the rules placing the logical axes on it (hashable: a static field)."""

    mesh: Mesh
    rules: tuple = DEFAULT_RULES

    def axis(self, name: str):
        """The mesh axis ``name`` is split over, or None (replicated)."""
        target = dict(self.rules).get(name)
        return target if target in self.mesh.shape else None

    def shards(self, name: str) -> int:
        """Parts the logical axis ``name`` is split into."""
        a = self.axis(name)
        return 1 if a is None else self.mesh.shape[a]

    def spec(self, *names) -> PartitionSpec:
        """The PartitionSpec of an array whose axes are ``names`` (None: replicated)."""
        return PartitionSpec(*(None if n is None else self.axis(n) for n in names))

    def sharding(self, *names) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*names))

    def check_divides(self, name: str, size: int, what: str):
        """ValueError unless the mesh axis of ``name`` divides ``size`` (the dimension ``what``)."""
        n = self.shards(name)
        if size % n:
            procs = {d.process_index for d in self.mesh.devices.flat}
            where = f" on {len(procs)} processes" if len(procs) > 1 else ""
            raise ValueError(
                f"mesh: axis {self.axis(name)!r} has {n} devices{where}, which does not divide {what} = {size} "
                f"(logical axis {name!r}); expected a mesh axis size that divides {size}"
            )

    def local_rows(self, x, *names):
        """The global array whose part on this process's devices is ``x`` (this process's rows
        of every axis in ``names`` split over processes; the whole of the others): how each
        process of a multi-process run feeds its own streams or requests
        (``jax.make_array_from_process_local_data``; one process: the whole array, placed)."""
        return jax.make_array_from_process_local_data(self.sharding(*names), x)

    def my_rows(self, x) -> np.ndarray:
        """This process's part of the global array ``x`` on the host: its devices' shards put
        side by side (the inverse of ``local_rows``)."""
        shards = {tuple((i.start, i.stop) for i in _slices(s.index, x.shape)): s for s in x.addressable_shards}
        lo = [min(k[d][0] for k in shards) for d in range(x.ndim)]
        hi = [max(k[d][1] for k in shards) for d in range(x.ndim)]
        out = np.empty([b - a for a, b in zip(lo, hi)], x.dtype)
        for k, s in shards.items():
            out[tuple(slice(a - l, b - l) for (a, b), l in zip(k, lo))] = np.asarray(s.data)
        return out

    def index(self, name: str):
        """Inside ``per_device``: this device's part of the logical axis ``name`` (i32[])."""
        a = self.axis(name)
        return jax.numpy.int32(0) if a is None else lax.axis_index(a)

    def check_placed(self, tree, what: str = "state"):
        """ValueError at trace time if ``tree``'s arrays sit on another mesh than this layout's
        (an op jitted for one mesh given a state placed on another: no silent reshard)."""
        want = self.mesh.abstract_mesh
        for x in jax.tree_util.tree_leaves(tree):
            got = getattr(jax.typeof(x).sharding, "mesh", None) if hasattr(x, "shape") else None
            if (
                got is not None
                and not got.empty
                and (got.axis_names, got.axis_sizes) != (want.axis_names, want.axis_sizes)
            ):
                raise ValueError(
                    f"{what}: laid out for mesh {dict(self.mesh.shape)}, but its arrays are placed on "
                    f"mesh {dict(zip(got.axis_names, got.axis_sizes))}; place the state on its own mesh "
                    f"(init(..., mesh=...)) or make a new one for this mesh"
                )


def _slices(index, shape):
    return [slice(*i.indices(n)[:2]) for i, n in zip(index, shape)]


def layout(mesh, rules=None) -> Layout | None:
    """A ``Layout`` for ``mesh`` (None: one device) with ``rules`` ({logical axis: mesh axis
    or None}, merged over ``DEFAULT_RULES``)."""
    if mesh is None:
        if rules is not None:
            raise ValueError("rules: expected None without a mesh, got rules for no mesh")
        return None
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    merged = dict(DEFAULT_RULES)
    for name, target in dict(rules or {}).items():
        if name not in AXES:
            raise ValueError(f"rules: expected logical axes among {AXES}, got {name!r}")
        if target is not None and target not in mesh.shape:
            raise ValueError(f"rules: {name!r} -> mesh axis {target!r}, but the mesh's axes are {tuple(mesh.shape)}")
        merged[name] = target
    return Layout(mesh, tuple(sorted(merged.items())))


def per_device(lay: Layout, fn, in_specs, out_specs):
    """``fn`` run on each device's part of its arguments (``jax.shard_map``, unchecked
    replication: the caches' ops compute replicated parts identically on every device)."""
    return _shard_map(fn, mesh=lay.mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK)


def on_devices(fn, state, *args, axes=(), out="state"):
    """``fn(state, *args)`` run by each device on its part of a cache state and of the
    arguments (``per_device`` over ``state.layout``), or called directly for a state on one
    device (``layout`` None).

    The state says how it splits: ``partition_specs()`` places its arrays on the layout's
    mesh; ``fn`` gets ``to_shard()`` of the device's part (one device's static config, no
    layout), and a state ``fn`` returns is put back with ``from_shard`` of the whole one.

    axes: per argument, its logical axes (the table above): a tuple of names, one per array
      axis (None: that axis replicated; an empty tuple, or None for the whole argument:
      replicated), or a pytree of ``PartitionSpec`` s of logical names that prefixes the
      argument (a ``Stacked``'s, a dataclass's: one spec for all its fields).
    out: the result's, likewise, "state" for a state; a list of them for a tuple of results.
    """
    lay = state.layout
    if lay is None:
        return fn(state, *args)
    lay.check_placed(state)

    def is_state(x):
        return isinstance(x, type(state))

    def body(part, *a):
        res = fn(part.to_shard(), *a)
        return jax.tree_util.tree_map(lambda x: state.from_shard(x) if is_state(x) else x, res, is_leaf=is_state)

    def place(names):
        if isinstance(names, str) and names == "state":
            return state.partition_specs()
        if names is None:
            return lay.spec()
        if isinstance(names, tuple) and all(n is None or isinstance(n, str) for n in names):
            return lay.spec(*names)
        return jax.tree_util.tree_map(lambda p: lay.spec(*p), names, is_leaf=lambda x: isinstance(x, PartitionSpec))

    in_specs = (state.partition_specs(),) + tuple(map(place, axes))
    out_specs = tuple(map(place, out)) if isinstance(out, list) else place(out)
    return per_device(lay, body, in_specs, out_specs)(state, *args)


def build(make, specs, lay: Layout):
    """``make()`` (a pytree of new arrays) computed straight into these PartitionSpecs: each
    device makes only its part (no device holds a whole sharded cache on the way), and it
    works across processes."""
    shardings = jax.tree_util.tree_map(
        lambda s: NamedSharding(lay.mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec)
    )
    return jax.jit(make, out_shardings=shardings)()


__all__ = ["AXES", "DEFAULT_RULES", "Layout", "build", "layout", "on_devices", "per_device"]

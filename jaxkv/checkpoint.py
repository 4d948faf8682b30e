"""Durable cache state: ``save`` a frame or hybrid cache to a directory, ``restore`` it in
another process (or onto another mesh) and continue bit-identically.

A checkpoint is a directory::

    path/
      jaxkv.json   format version, the cache kind, its spec / config, each array's
                   shape, dtype and checksum (written last: its presence marks a complete save)
      arrays/      the arrays, an Orbax (``orbax-checkpoint``) PyTree checkpoint

The save goes to a temporary sibling directory that is renamed into place when complete,
so ``path`` either holds a whole checkpoint or nothing. ``restore`` refuses what does not
match (another format version, another kind, a spec different from ``like``'s) with a
``CheckpointError`` that says what differs, and checks every array's checksum
(position-weighted sums of its 32-bit words, computed where the array lives), so a
truncated or corrupted checkpoint is reported, never loaded half way. Everything in the
state is saved: the sticky error field, and a deferred frame still pending (``commit`` or
``rollback`` it after the restore as before the save).

Orbax restores each array onto the sharding of ``like``'s (a state laid out on the target
devices), or, with ``mesh``, replicated over that mesh; without either, onto the default
device. In a multi-process run (``jaxkv.launch``) every process calls ``save`` / ``restore``
with the same path: each writes and reads its own shards, so a checkpoint written by N
processes restores in M. A hybrid cache restores onto as many request shards as it was
saved from (its block ids are local to a shard); a frame cache onto any layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import frame, hybrid
from jaxkv.frame.spec import FrameSpec
from jaxkv.hybrid.config import HybridConfig

FORMAT = "jaxkv-cache"
VERSION = 1
META = "jaxkv.json"
ARRAYS = "arrays"

# kind -> (state class, spec field, spec class, abstract state of a spec)
_KINDS = {
    "frame": (frame.FrameCacheState, "spec", FrameSpec, frame.init),
    "hybrid": (hybrid.HybridCacheState, "config", HybridConfig, hybrid.init),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored as asked: incomplete, corrupted, or another
    format, kind or spec than expected. The message says which, and where."""


def kind_of(state) -> str:
    """``"frame"`` or ``"hybrid"``; TypeError for anything else."""
    for kind, (cls, *_rest) in _KINDS.items():
        if isinstance(state, cls):
            return kind
    raise TypeError(f"state: expected a frame.FrameCacheState or hybrid.HybridCacheState, got {type(state).__name__}")


def spec_of(state):
    """The state's FrameSpec or HybridConfig."""
    return getattr(state, _KINDS[kind_of(state)][1])


def spec_to_json(spec) -> dict:
    """A FrameSpec / HybridConfig as JSON-able fields."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()}


def spec_from_json(kind: str, d: dict):
    """``spec_to_json``'s inverse for a ``"frame"`` or ``"hybrid"`` cache."""
    cls = _KINDS[kind][2]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CheckpointError(f"{kind} spec: fields {unknown} are not in this jaxkv's {cls.__name__}")
    return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


def leaves(state) -> dict:
    """{key path: array} of the state's arrays, in pytree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(p): x for p, x in flat}


@jax.jit
def _checksum(x):
    """u32[2]: the sum of the array's 32-bit words and their sum weighted by 2i + 1 (mod 2^32),
    on the device that holds it (no copy to the host): any changed word, or a moved one,
    changes it."""
    b = x.reshape(-1)
    if b.dtype == jnp.bool_:
        b = b.astype(jnp.uint8)
    if b.dtype != jnp.uint8:
        b = lax.bitcast_convert_type(b, jnp.uint8).reshape(-1)
    b = jnp.pad(b, (0, -b.size % 4)).reshape(-1, 4)
    w = lax.bitcast_convert_type(b, jnp.uint32)
    i = jnp.arange(w.shape[0], dtype=jnp.uint32)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)])


def _sums(arrays: dict) -> dict:
    """{key: [s1, s2]}: every array's checksum, fetched to the host in one transfer."""
    sums = jax.device_get({k: _checksum(x) if x.size else jnp.zeros(2, jnp.uint32) for k, x in arrays.items()})
    return {k: [int(v) for v in np.asarray(s)] for k, s in sums.items()}


def _orbax():
    """``orbax.checkpoint``, or a ModuleNotFoundError that gives the pip command."""
    try:
        import orbax.checkpoint as ocp
    except ModuleNotFoundError as e:
        if (e.name or "orbax").split(".")[0] != "orbax":
            raise  # orbax is there, something it imports is not
        raise ModuleNotFoundError(
            'jaxkv.save / jaxkv.restore need orbax-checkpoint, not installed here: pip install "jaxkv[checkpoint]"',
            name="orbax",
        ) from None
    return ocp


_drain_lock = threading.Lock()
_drain_users = 0


def _drain_then_close(loop):
    """``loop``, whose ``close`` first runs its pending tasks to their end, as ``asyncio.run`` does."""
    close = loop.close

    def drain_then_close():
        if not loop.is_closed() and not loop.is_running():
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        close()

    try:
        loop.close = drain_then_close
    except AttributeError:  # a loop type without instance attributes (uvloop): closes as before
        pass
    return loop


@contextlib.contextmanager
def _checkpointer():
    """An Orbax PyTree checkpointer, closed after use, whose event loops end cleanly.

    Orbax runs each save / restore on a new asyncio loop that it closes when the call returns
    or raises. A read that fails (a corrupted checkpoint) raises while the other arrays'
    tensorstore reads are still in flight; each of those, when it ends, posts its result to
    the closed loop, and Python prints "RuntimeError: Event loop is closed" from
    tensorstore's thread. Loops made inside this block finish their pending tasks before
    they close, so every read ends while its loop is alive (docs/checkpoint.md).
    """
    global _drain_users
    ocp = _orbax()
    get_policy = getattr(asyncio.events, "_get_event_loop_policy", None) or asyncio.get_event_loop_policy
    policy = get_policy()  # the private spelling: the public one warns from Python 3.14
    with _drain_lock:
        if _drain_users == 0:
            try:  # asyncio.new_event_loop() asks the policy
                policy.new_event_loop = lambda: _drain_then_close(type(policy).new_event_loop(policy))
            except AttributeError:  # a policy type without instance attributes: loops close as before
                pass
        _drain_users += 1
    ckptr = ocp.PyTreeCheckpointer()
    try:
        yield ckptr
    finally:
        ckptr.close()
        with _drain_lock:
            _drain_users -= 1
            if _drain_users == 0 and "new_event_loop" in getattr(policy, "__dict__", {}):
                del policy.new_event_loop


def _as_tree(arrays: dict) -> dict:
    """Orbax wants string keys it can use as names: index the arrays."""
    return {f"a{i:04d}": x for i, x in enumerate(arrays.values())}


@contextlib.contextmanager
def new_directory(path):
    """Yield a temporary sibling of the new directory ``path`` to fill; it becomes ``path``
    when the block completes, and is removed if it raises: ``path`` is whole or absent.

    In a multi-process run every process enters the block with the same ``path`` and gets the
    same sibling (made and renamed by process 0, between barriers): each writes its own part."""
    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"path: {path} exists; a save writes a new directory")
    if jax.process_count() == 1:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    else:
        tmp = path.parent / f".{path.name}.saving.tmp"
        if jax.process_index() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died half way
            tmp.mkdir(parents=True)
        _barrier(f"jaxkv.save {path}: begin")
    try:
        yield tmp
        _barrier(f"jaxkv.save {path}: written")
        if jax.process_index() == 0:
            os.replace(tmp, path)
        _barrier(f"jaxkv.save {path}: renamed")
    finally:
        if tmp.exists() and jax.process_index() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _barrier(name: str):
    """Every process of a multi-process run reaches this point before any goes on."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _write(path, kind: str, spec: dict, arrays: dict) -> Path:
    """The checkpoint directory ``path`` (new) holding ``arrays`` ({name: array}) and metadata."""
    ocp = _orbax()
    path = Path(path).absolute()
    sums = _sums(arrays)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "spec": spec,
        "arrays": {k: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": sums[k]} for k, x in arrays.items()},
    }
    with new_directory(path) as tmp, _checkpointer() as ckptr:
        ckptr.save(tmp / ARRAYS, args=ocp.args.PyTreeSave(_as_tree(arrays)))
        if jax.process_index() == 0:
            (tmp / META).write_text(json.dumps(meta, indent=1))
    return path


def _read(path, meta: dict, like: dict, sharding, what: str) -> list:
    """The arrays of the checkpoint at ``path``, in ``like``'s order ({name: array or
    ShapeDtypeStruct}), each placed by ``sharding(like[name])`` and checksum-checked."""
    saved = meta["arrays"]
    if list(saved) != list(like):
        raise CheckpointError(f"{path}: its arrays {list(saved)[:4]}... do not match {what}'s {list(like)[:4]}...")
    for k, x in like.items():
        s = saved[k]
        if tuple(s["shape"]) != tuple(x.shape) or s["dtype"] != str(x.dtype):
            raise CheckpointError(f"{path}: array {k} is {s['dtype']}{s['shape']}, {what} has {x.dtype}{list(x.shape)}")
    ocp = _orbax()
    items = _as_tree({k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)) for k, x in like.items()})
    try:
        with _checkpointer() as ckptr:
            restored = ckptr.restore(
                path / ARRAYS,
                args=ocp.args.PyTreeRestore(
                    item=items, restore_args=jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), items)
                ),
            )
    except ModuleNotFoundError:
        raise
    except Exception as e:  # orbax / tensorstore: missing or unreadable files
        raise CheckpointError(
            f"{path}: the arrays cannot be read (an incomplete or corrupted checkpoint): "
            f"{type(e).__name__}: {str(e)[:300]}"
        ) from None
    values = [restored[name] for name in items]
    sums = _sums(dict(zip(like, values)))
    for k in like:
        if sums[k] != saved[k]["checksum"]:
            raise CheckpointError(f"{path}: array {k} fails its checksum (a corrupted checkpoint)")
    return values


def save(path, state) -> Path:
    """Save a frame or hybrid cache state to the directory ``path`` (which must not exist).

    Blocks until the checkpoint is complete on disk; returns its path."""
    _orbax()
    return _write(path, kind_of(state), spec_to_json(spec_of(state)), leaves(state))


def save_arrays(path, arrays: dict) -> Path:
    """Save ``{name: array}`` (any arrays: a model's other state beside its caches) to the
    new directory ``path``, with the same metadata, checksums and atomicity as ``save``."""
    _orbax()
    return _write(path, "arrays", {}, dict(arrays))


def restore_arrays(path, like: dict) -> dict:
    """``save_arrays``' arrays, checked against ``like`` ({name: array}: names, shapes,
    dtypes) and placed on its arrays' shardings."""
    _orbax()
    path = Path(path).absolute()
    meta = read_meta(path)
    if meta["kind"] != "arrays":
        raise CheckpointError(f"{path} holds a {meta['kind']} cache, not arrays (use restore)")
    return dict(zip(like, _read(path, meta, dict(like), lambda x: x.sharding, "like")))


def read_meta(path) -> dict:
    """The checkpoint's metadata (``jaxkv.json``), checked to be a complete jaxkv checkpoint."""
    path = Path(path).absolute()
    f = path / META
    if not f.is_file():
        what = "does not exist" if not path.exists() else f"has no {META} (an incomplete or foreign checkpoint)"
        raise CheckpointError(f"path: {path} {what}")
    try:
        meta = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f}: corrupted metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: expected format {FORMAT!r}, got {meta.get('format')!r}")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{f}: format version {meta.get('version')} is not this jaxkv's ({VERSION})")
    if meta.get("kind") not in (*_KINDS, "arrays"):
        raise CheckpointError(f"{f}: expected kind 'frame', 'hybrid' or 'arrays', got {meta.get('kind')!r}")
    return meta


def _request_shards(shapes: dict) -> int:
    """Request shards of a hybrid cache from its arrays' shapes: ``num_free`` is i32[] on one
    device and i32[S] in a state split S ways (jaxkv.sharding)."""
    shape = next(v for k, v in shapes.items() if k.endswith(".num_free"))
    return int(shape[0]) if len(shape) else 1


def restore(path, like=None, mesh=None):
    """The state saved at ``path``.

    like: a state of the same kind and spec (its arrays' shardings place the restored
      arrays; its values are not read), or None (the spec comes from the checkpoint).
    mesh: with ``like=None``, a ``jax.sharding.Mesh`` to replicate the arrays over.
    """
    _orbax()
    path = Path(path).absolute()
    meta = read_meta(path)
    kind = meta["kind"]
    if kind == "arrays":
        raise CheckpointError(f"{path} holds arrays, not a cache (use restore_arrays)")
    spec = spec_from_json(kind, meta["spec"])
    if like is not None:
        if kind_of(like) != kind:
            raise CheckpointError(f"like: a {kind_of(like)} cache, but {path} holds a {kind} cache")
        want = spec_of(like)
        if want != spec:
            diff = {k: (v, getattr(spec, k)) for k, v in dataclasses.asdict(want).items() if getattr(spec, k) != v}
            raise CheckpointError(
                f"like: its spec differs from the checkpoint's at {path}: "
                + ", ".join(f"{k}={a!r} (checkpoint: {b!r})" for k, (a, b) in diff.items())
            )
        target = like
    else:
        target = jax.eval_shape(lambda: _KINDS[kind][3](spec))

    def sharding(x):
        if like is not None:
            return x.sharding
        if mesh is not None:
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])

    target_leaves = leaves(target)
    if kind == "hybrid":
        saved = _request_shards({k: v["shape"] for k, v in meta["arrays"].items()})
        want = _request_shards({k: x.shape for k, x in target_leaves.items()})
        if saved != want:
            raise CheckpointError(
                f"{'like' if like is not None else 'mesh'}: {path} holds a hybrid cache split into {saved} "
                f"request shard(s) (each with its own blocks and block ids), but the target is laid out in "
                f"{want}; restore onto like=hybrid.init(config, mesh=...) with {saved} device(s) on the "
                "mesh axis of 'requests' (any number of processes)"
            )
    values = _read(path, meta, target_leaves, sharding, f"a {kind} cache of this spec")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), values)


__all__ = [
    "CheckpointError",
    "kind_of",
    "leaves",
    "new_directory",
    "read_meta",
    "restore",
    "restore_arrays",
    "save",
    "save_arrays",
    "spec_from_json",
    "spec_of",
    "spec_to_json",
]

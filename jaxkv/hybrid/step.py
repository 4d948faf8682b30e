"""Step: the boundary between the hybrid cache and a model's forward pass.

``prepare_forward`` checks a batch against the cache, allocates every block the step's
flushes will need (for every ratio, from the device-side free stacks, with no Python loop
over requests) and returns a ``Step``; each layer then calls the layer operations with
that ``Step``. ``finish`` returns a request's blocks and empties its slot.

On a state laid out on a mesh (``jaxkv.sharding``), every op runs per device on that
device's request shard (``on_requests``). A batch is laid out like the slots: its rows are
split over the data axis in equal parts, and the rows of part ``s`` must be requests of
shard ``s`` (slots ``s * R/S .. (s+1) * R/S - 1``); a row whose slot another shard owns
is refused like an out-of-range slot. A ``Step``'s slots stay global slot ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxkv._pytree import cache_dataclass
from jaxkv.errors import Fault, record
from jaxkv.hybrid.state import BlockAllocator, HybridCacheState
from jaxkv.math.compressor import empty_tail
from jaxkv.sharding import on_devices
from jaxkv.stacked import Stacked


@cache_dataclass
class Step:
    """One forward step of a batch of B requests.

    Batch row ``b`` is request slot ``slot[b]``. Its tokens have positions
    ``start[b] .. start[b] + num_tokens[b] - 1`` and sit at ``[b, :num_tokens[b]]`` of every
    per-token array a layer op takes (``[B, T, ...]``; later rows are padding, ignored).
    Decode is ``T = 1``; prefill any ``T``; rows may sit at different positions.

    A row that ``prepare_forward`` refused (a fault is recorded in the state) has
    ``active[b] = False`` and ``num_tokens[b] = 0``: the layer ops leave its request
    untouched and its outputs are meaningless.

    slot: i32[B]        request slot, clamped into [0, R) (use it to read)
    write_slot: i32[B]  slot, or R where inactive (scatters drop out-of-range rows)
    start: i32[B]       position of the row's first token
    num_tokens: i32[B]
    active: bool[B]
    """

    slot: jnp.ndarray
    write_slot: jnp.ndarray
    start: jnp.ndarray
    num_tokens: jnp.ndarray
    active: jnp.ndarray


def query_positions(step: Step, T: int):
    """i32[B, T] absolute position of each token row of the step, ``start + t`` (padding rows
    continue the count): where a query sits, and where the row's token is written."""
    return step.start[:, None] + jnp.arange(T)[None, :]


def on_requests(fn, state: HybridCacheState, *args, axes=(), out="state"):
    """``fn(state, *args)`` run by each device on its request shard (``jaxkv.sharding.on_devices``),
    or directly for a state on one device. Inside, the state is one shard's (a
    ``local_config``, its own block ids) and a ``Step``'s slots are the shard's own.

    axes: per arg, "batch" (leading axis: the batch rows, split like the requests; a
      ``Stacked`` array's second axis; every field of a ``Step``) or None (replicated).
      An arg that is None (an optional input not given) reaches ``fn`` as None.
    out: the same for the result ("state" for a state), or a tuple of them.
    """
    lay = state.layout
    if lay is None:
        return fn(state, *args)
    R = state.config.max_requests
    given = tuple(x is not None for x in args)

    def in_place_of_none(a):  # the given args, with the None ones back where they were
        a = iter(a)
        return tuple(next(a) if g else None for g in given)

    def is_step(x):
        return isinstance(x, Step)

    def steps(tree, base, Rl, to_local):  # a Step's slots: global ids <-> the shard's own
        def convert(x):
            if not is_step(x):
                return x
            if to_local:
                return x.replace(slot=x.slot - base, write_slot=jnp.where(x.write_slot >= R, Rl, x.write_slot - base))
            return x.replace(slot=x.slot + base, write_slot=jnp.where(x.write_slot >= Rl, R, x.write_slot + base))

        return jax.tree_util.tree_map(convert, tree, is_leaf=is_step)

    def on_shard(st, *a):
        Rl = st.config.max_requests
        base = lay.index("requests") * Rl
        return steps(fn(st, *in_place_of_none(steps(a, base, Rl, True))), base, Rl, False)

    def logical(kind, x=None):  # "batch" as logical axes (jaxkv.sharding)
        if kind in ("state", None):
            return kind
        if isinstance(x, Stacked):
            return Stacked(PartitionSpec(None, "requests"), x.index)
        return ("requests",)

    kept = [(k, x) for k, x in zip(axes, args) if x is not None]
    return on_devices(
        on_shard,
        state,
        *(x for _, x in kept),
        axes=tuple(logical(k, x) for k, x in kept),
        out=[logical(k) for k in out] if isinstance(out, tuple) else logical(out),
    )


def _shard_slots(slots, lay, Rl: int):
    """Global slot ids as the ids of this request shard of ``lay`` (``Rl`` slots each); -1
    where another shard owns the slot (callers then refuse the row as out of range)."""
    base = lay.index("requests") * Rl
    return jnp.where((slots >= base) & (slots < base + Rl), slots - base, -1)


def _check_batch(state, B: int):
    if state.layout is not None:
        state.layout.check_divides("requests", B, "the batch's rows (slots)")


def _as_i32(name, x, shape=None):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}: expected an integer array, got dtype {x.dtype}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    return x.astype(jnp.int32)


def _cumsum_excl(x):
    return jnp.cumsum(x) - x


def _slot_rows(slots, R: int, counted=None):
    """(in_range, slot, repeated) of a batch's slots (i32[F]): ``slot`` clamped into range for
    gathers; ``repeated``: in range and given more than once among the rows ``counted``
    (default: every row)."""
    in_range = (slots >= 0) & (slots < R)
    counted = in_range if counted is None else in_range & counted
    count = jnp.zeros((R,), jnp.int32).at[jnp.where(counted, slots, R)].add(1, mode="drop")
    slot = jnp.where(in_range, slots, 0)
    return in_range, slot, in_range & (count[slot] > 1)


def _holds(state, slot):
    """bool[F]: the slots ``slot`` (i32[F], in range) hold tokens or blocks."""
    held = state.position[slot] > 0
    for al in state.alloc:
        held |= al.owned[slot] > 0
    return held


def _pop_blocks(al: BlockAllocator, n, K: int):
    """(blk i32[F, K], take bool[F, K]): the ``n[f]`` (<= K) blocks row f takes from the top of
    ``al``'s free stack, rows in order; ``take`` marks the real ones. Callers check first
    that ``cumsum(n) <= num_free`` and lower ``num_free`` by ``sum(n)``."""
    k = jnp.arange(K)[None, :]
    blk = al.free[jnp.clip(al.num_free - 1 - _cumsum_excl(n)[:, None] - k, 0, al.free.shape[0] - 1)]
    return blk, k < n[:, None]


def _bad_rows(error, R: int, out_of_range, repeated):
    """``error`` (u32[R + 1]) with SLOT_OUT_OF_RANGE / SLOT_REPEATED recorded in its last word,
    the batch's bad-row entry, where any row had them."""
    word = record(
        record(error[R], jnp.any(out_of_range), Fault.SLOT_OUT_OF_RANGE), jnp.any(repeated), Fault.SLOT_REPEATED
    )
    return error.at[R].set(word)


@functools.partial(jax.jit, static_argnames="chunk", donate_argnums=0)
def prepare_forward(state: HybridCacheState, slots, positions, num_tokens=None, *, chunk: int = 1):
    """Check a batch, allocate the blocks its flushes need, advance positions.

    Args:
      state: the cache (donated).
      slots: i32[B] request slots. A slot at position 0 is a new request.
      positions: i32[B] position of each row's first token; must equal the tokens the
        request has seen (``state.position[slot]``).
      num_tokens: i32[B] tokens per row, 0..chunk (default: ``chunk`` for every row).
      chunk: T, the token axis of this step's per-token arrays (static; 1 = decode).
    Returns:
      (state, step). Rows with a bad slot, a position that goes backwards or skips, a
      token count out of range, or blocks the pools cannot supply are refused: a fault
      bit is recorded, the request is left as it was, other rows proceed.
    """
    slots = _as_i32("slots", slots)
    if slots.ndim != 1:
        raise ValueError(f"slots: expected shape [B], got {tuple(slots.shape)}")
    B = slots.shape[0]
    positions = _as_i32("positions", positions, (B,))
    if chunk < 1:
        raise ValueError(f"chunk: expected a positive int, got {chunk}")
    n = jnp.full((B,), chunk, jnp.int32) if num_tokens is None else _as_i32("num_tokens", num_tokens, (B,))
    _check_batch(state, B)
    lay = state.layout

    def local(st, slots, positions, n):  # a shard's own slots count from 0
        base = 0 if lay is None else lay.index("requests") * st.config.max_requests
        return _prepare(st, slots - base, positions, n, chunk=chunk)

    return on_requests(local, state, slots, positions, n, axes=("batch",) * 3, out=("state", "batch"))


def _prepare(state, slots, positions, n, *, chunk):
    c = state.config
    R = c.max_requests
    in_range, slot, repeated = _slot_rows(slots, R)
    seen = state.position[slot]
    backwards = in_range & ~repeated & (positions < seen)
    gap = in_range & ~repeated & (positions > seen)
    bad_n = in_range & ~repeated & ((n < 0) | (n > chunk) | (positions + n > c.max_context))
    ok = in_range & ~repeated & ~backwards & ~gap & ~bad_n

    # blocks: need per ratio, granted to the rows that fit (a prefix of the rows that need any)
    needs = []
    fits = ok
    for r, al in zip(c.ratios, state.alloc):
        after = -(-((positions + n) // r) // c.block_size)  # blocks covering the entries after the step
        need = jnp.where(ok, jnp.maximum(after - al.owned[slot], 0), 0)
        fits = fits & (jnp.cumsum(need) <= al.num_free)
        needs.append(need)
    active = ok & fits
    pool_short = ok & ~fits

    write_slot = jnp.where(active, slot, R)
    new_alloc = []
    for r, al, need in zip(c.ratios, state.alloc, needs):
        need = jnp.where(active, need, 0)
        max_new = -(-chunk // (r * c.block_size)) + 1  # most blocks one row can need this step
        blk, take = _pop_blocks(al, need, max_new)
        cols = al.owned[slot][:, None] + jnp.arange(max_new)[None, :]
        new_alloc.append(
            al.replace(
                table=al.table.at[jnp.where(take, write_slot[:, None], R), cols].set(blk, mode="drop"),
                num_free=al.num_free - jnp.sum(need),
                owned=al.owned.at[write_slot].add(need, mode="drop"),
            )
        )

    err = _bad_rows(state.error, R, ~in_range, repeated)
    row_err = err[slot]
    for mask, fault in (
        (backwards, Fault.POSITION_BACKWARDS),
        (gap, Fault.POSITION_GAP),
        (bad_n, Fault.CONTEXT_EXHAUSTED),
        (pool_short, Fault.POOL_EXHAUSTED),
    ):
        row_err = record(row_err, mask, fault)
    own = jnp.where(in_range & ~repeated, slot, R + 1)  # unique slots only; others drop
    err = err.at[own].set(row_err, mode="drop")

    step = Step(slot=slot, write_slot=write_slot, start=positions, num_tokens=jnp.where(active, n, 0), active=active)
    new_pos = state.position.at[write_slot].set(positions + n, mode="drop")
    return state.replace(position=new_pos, alloc=tuple(new_alloc), error=err), step


@functools.partial(jax.jit, donate_argnums=0)
def finish(state: HybridCacheState, slots):
    """Release requests: return their blocks to the free stacks and empty their slots.

    slots: i32[F]. Out-of-range or repeated slots record a fault and are skipped; a slot that
    holds nothing (released twice) records SLOT_EMPTY. On a
    mesh, each shard finishes the slots it owns (the slots need no layout).
    """
    slots = _as_i32("slots", slots)
    if slots.ndim != 1:
        raise ValueError(f"slots: expected shape [F], got {tuple(slots.shape)}")
    if state.layout is None:
        return _finish(state, slots, jnp.ones(slots.shape, jnp.bool_))
    R, lay = state.config.max_requests, state.layout

    def local(st, slots):
        Rl = st.config.max_requests
        shard = lay.index("requests")
        base = shard * Rl
        mine = (slots >= base) & (slots < base + Rl)  # an out-of-range slot is shard 0's fault
        mine |= ((slots < 0) | (slots >= R)) & (shard == 0)
        return _finish(st, jnp.where(slots < 0, slots, slots - base), mine)

    return on_requests(local, state, slots, axes=(None,))


def holders(table, num_blocks: int):
    """i32[num_blocks]: how many block-table entries name each block. The tables are the
    only record of who holds a block (``hybrid.share`` puts one block in several), so
    a count kept beside them could not drift from them."""
    flat = table.reshape(-1)
    return jnp.zeros((num_blocks,), jnp.int32).at[jnp.where(flat >= 0, flat, num_blocks)].add(1, mode="drop")


def _release(al: BlockAllocator, slot, ok, ws) -> BlockAllocator:
    """``al`` with the rows ``ws`` (R: none) emptied; each block they held that no other
    table still names goes back on the free stack, once."""
    nb = al.free.shape[0]
    rows = al.table[slot]  # i32[F, max_blocks]
    held = ((jnp.arange(rows.shape[1]) < al.owned[slot][:, None]) & ok[:, None]).reshape(-1)
    flat = jnp.where(held, rows.reshape(-1), nb)
    table = al.table.at[ws].set(-1, mode="drop")
    n = jnp.arange(flat.shape[0])
    first = jnp.full((nb + 1,), flat.shape[0], jnp.int32).at[flat].min(n)  # a block named twice: once
    last_holder = held & (holders(table, nb)[jnp.minimum(flat, nb - 1)] == 0) & (first[flat] == n)
    dest = al.num_free + jnp.cumsum(last_holder) - 1
    return BlockAllocator(
        free=al.free.at[jnp.where(last_holder, dest, nb)].set(flat, mode="drop"),
        num_free=al.num_free + jnp.sum(last_holder),
        table=table,
        owned=al.owned.at[ws].set(0, mode="drop"),
    )


def _finish(state, slots, mine, empty_is_fault: bool = True):
    """``finish`` of the rows where ``mine`` holds; the others are not looked at.
    ``empty_is_fault``: a slot holding nothing records SLOT_EMPTY (``offload`` of one is
    documented as giving an empty image instead)."""
    c = state.config
    R = c.max_requests
    in_range, slot, repeated = _slot_rows(slots, R, mine)
    ok = mine & in_range & ~repeated
    empty = ok & ~_holds(state, slot) & empty_is_fault
    ws = jnp.where(ok, slot, R)
    new_alloc = [_release(al, slot, ok, ws) for al in state.alloc]
    err = _bad_rows(state.error, R, mine & ~in_range, mine & repeated)
    err = err.at[jnp.where(empty, slot, R + 1)].set(record(err[slot], empty, Fault.SLOT_EMPTY), mode="drop")

    def reset(t):  # f32[Lg, R, streams, 3, w]
        return t.at[:, ws].set(empty_tail((), t.shape[2], t.shape[-1]), mode="drop")

    return state.replace(
        position=state.position.at[ws].set(0, mode="drop"),
        tails=tuple(map(reset, state.tails)),
        alloc=tuple(new_alloc),
        error=err,
    )

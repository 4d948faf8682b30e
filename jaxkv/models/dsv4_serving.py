"""A serving loop over the hybrid cache: continuous batching with prefix hits and preemption.

``Server`` runs a stack of DeepSeek-V4 attention blocks (``models.deepseek_v4``, random
weights, a residual stream, greedy decoding) the way an engine runs a model: requests are
admitted into free slots as they arrive, prefilled ``chunk`` tokens per step while the
others decode one token in the same step,
finished, and, when the pools run short, preempted by ``hybrid.offload`` to pinned host
memory and reloaded later. Every step is one jitted call over all slots (a slot with
nothing to do takes 0 tokens), so it compiles twice: the prefill and the decode shape.

Prefix hits are exact: at each prefill chunk boundary the loop keeps a *snapshot* of the
prompt so far (``hybrid.share`` of the whole request into a spare slot: its blocks shared,
its ring and tails copied) and indexes it in a ``hybrid.PrefixIndex``; a new request starts
from the longest snapshot its prompt begins with (``lookup(whole=True)``). Snapshots are
retained slots, evicted least recently used past ``snapshots``, or when blocks or slots run
short. A re-fed hit (a prefix ending inside another request) is exact for the cache given
the same per-layer inputs, but a model re-computes those inputs from a shorter window, so
this loop does not take them.

    python -m jaxkv.models.dsv4_serving            # a shared-prefix workload, with and without sharing
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import hybrid as H
from jaxkv.models.deepseek_v4 import V4Attention, V4AttentionConfig


class V4Stack(nnx.Module):
    """Embedding, ``V4Attention`` blocks on a residual stream, tied logits: enough model to
    generate tokens from the cache (no MoE, no MLP)."""

    def __init__(self, config: V4AttentionConfig, vocab: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, config.dim), jnp.float32).astype(jnp.bfloat16))
        self.blocks = nnx.List([V4Attention(config, i, rngs=rngs) for i in range(config.cache.num_layers)])

    def __call__(self, state, step, tokens):  # tokens: i32[B, T] -> (state, i32[B] next token of each row)
        x = self.embed[...][tokens]
        for block in self.blocks:
            state, y = block(state, step, x)
            x = x + y
        last = jnp.take_along_axis(x, jnp.maximum(step.num_tokens - 1, 0)[:, None, None], axis=1)[:, 0]
        logits = jnp.einsum("bd,vd->bv", last, self.embed[...], preferred_element_type=jnp.float32)
        return state, jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(nnx.jit, static_argnames="chunk", donate_argnums=1)
def _forward(model, state, tokens, positions, counts, *, chunk):
    state, step = H.prepare_forward(state, jnp.arange(tokens.shape[0]), positions, counts, chunk=chunk)
    return model(state, step, tokens)


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_new: int
    arrival: int = 0  # the step it arrives at
    out: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    pos: int = 0  # tokens in the cache
    hit: int = 0  # tokens taken from a snapshot
    image: object = None  # host copy while preempted

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new


class Server:
    """The loop. ``share=False`` runs the same workload with no prefix cache (the baseline).

    Args:
      model: a ``V4Stack`` whose blocks' ``config.cache`` is the cache's config.
      chunk: prefill tokens per step (and the snapshot spacing).
      snapshots: most snapshot slots kept on the device.
      host_snapshots: most snapshots kept in pinned host memory once evicted from the device
        (``hybrid.offload``; a hit there is reloaded into a spare slot, then shared).
    """

    def __init__(
        self, model: V4Stack, chunk: int = 32, *, share: bool = True, snapshots: int = 8, host_snapshots: int = 0
    ):
        if share and snapshots < 1:
            raise ValueError(f"snapshots: expected at least 1 with share=True, got {snapshots}")
        self.model, self.chunk, self.share = model, chunk, share
        self.host_snapshots = host_snapshots
        self.host: collections.OrderedDict[tuple, H.RequestImage] = collections.OrderedDict()  # oldest first
        self.config = model.blocks[0].config.cache
        self.state = H.init(self.config)
        self.index = H.PrefixIndex(chunk=chunk, capacity=snapshots)
        self.free = list(range(self.config.max_requests))[::-1]
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: collections.deque[Request] = collections.deque()
        self.snapshot_of: dict[int, tuple] = {}  # snapshot slot -> the tokens it holds
        self.history: list[dict] = []
        self.clock = self.prefilled = self.prompt_tokens = self.hit_tokens = self.preemptions = self.host_hits = 0

    def submit(self, prompt, max_new: int, arrival: int = 0) -> Request:
        """Queue a request that arrives at step ``arrival`` (in order of arrival)."""
        req = Request([int(t) for t in prompt], max_new, arrival)
        self.waiting.append(req)
        self.prompt_tokens += len(req.prompt)
        return req

    # ------------------------------------------------------------------ slots and blocks
    def _take_slot(self) -> int | None:
        if not self.free and self.index.retained:
            self._drop_snapshot(self.index.evict())
        return self.free.pop() if self.free else None

    def _drop_snapshot(self, slot: int) -> None:
        """An evicted snapshot leaves the device: to host memory if it keeps any, else gone."""
        held = self.snapshot_of.pop(slot, None)
        if self.host_snapshots and held is not None:
            self.state, image = H.offload(self.state, jnp.asarray([slot], jnp.int32))
            self.host[held] = H.to_host(image)
            while len(self.host) > self.host_snapshots:
                self.host.popitem(last=False)
        else:
            self.state = H.finish(self.state, jnp.asarray([slot], jnp.int32))
        self.free.append(slot)

    def _from_host(self, prompt: list[int], longer_than: int) -> tuple[int, int] | None:
        """The longest host snapshot that ``prompt`` begins with (and longer than
        ``longer_than``), reloaded into a spare slot and retained: (slot, length)."""
        best = max(
            (k for k in self.host if longer_than < len(k) < len(prompt) and tuple(prompt[: len(k)]) == k),
            key=len,
            default=None,
        )
        if best is None or not self._room(len(self.running) + 2):
            return None
        image = self.host.pop(best)  # before a slot is freed: that may move another snapshot here
        slot = self._take_slot()
        if slot is None:
            self.host[best] = image
            return None
        self.state = H.reload(self.state, jnp.asarray([slot], jnp.int32), image)
        self.index.add(slot, best)
        self.snapshot_of[slot] = best
        for old in self.index.retain(slot):  # the newest is never the one evicted (snapshots >= 1)
            self._drop_snapshot(old)
        self.host_hits += 1
        return slot, len(best)

    def _blocks_free(self) -> list[int]:
        return [int(a.num_free) for a in self.state.alloc]

    def _blocks_per_chunk(self) -> list[int]:
        """Most blocks one row can take in one prefill step, per ratio."""
        return [-(-self.chunk // (r * self.config.block_size)) + 1 for r in self.config.ratios]

    def _room(self, rows: int) -> bool:
        return all(f >= rows * n for f, n in zip(self._blocks_free(), self._blocks_per_chunk()))

    # ------------------------------------------------------------------ the loop
    def _admit(self) -> None:
        while self.swapped and self._room(len(self.running) + 1):  # preempted requests first
            slot = self._take_slot()
            if slot is None:
                return
            req = self.swapped.popleft()
            self.state = H.reload(self.state, jnp.asarray([slot], jnp.int32), req.image)
            req.slot, req.image = slot, None
            self.running.append(req)
        while self.waiting and self.waiting[0].arrival <= self.clock and self._room(len(self.running) + 1):
            slot = self._take_slot()
            if slot is None:
                return
            req = self.waiting.popleft()
            req.slot = slot
            hit = self.index.lookup(req.prompt, whole=True) if self.share else None
            if self.share and self.host:
                hit = self._from_host(req.prompt, hit[1] if hit else 0) or hit
            if hit is not None:
                src, n = hit
                self.state = H.share(self.state, [slot], [src], [n])
                req.pos = req.hit = n
                self.hit_tokens += n
            self.running.append(req)

    def _preempt(self) -> None:
        """Free blocks until the running requests can step: snapshots first, then the
        request admitted last goes to host memory."""
        while not self._room(len(self.running)):
            if self.index.retained:
                self._drop_snapshot(self.index.evict())
                continue
            if len(self.running) <= 1:
                return
            req = self.running.pop()
            self.state, image = H.offload(self.state, jnp.asarray([req.slot], jnp.int32))
            req.image = H.to_host(image)
            self.free.append(req.slot)
            req.slot = None
            self.swapped.appendleft(req)
            self.preemptions += 1

    def _snapshot(self, req: Request) -> None:
        """Keep the prompt so far as a retained slot, unless one holds it already."""
        held = tuple(req.prompt[: req.pos])
        if held in self.snapshot_of.values():
            return
        slot = self._take_slot()
        if slot is None:
            return
        self.state = H.share(self.state, [slot], [req.slot], [req.pos])
        self.index.add(slot, held)
        self.snapshot_of[slot] = held
        for old in self.index.retain(slot):
            self._drop_snapshot(old)

    def step(self) -> None:
        """One iteration: admit, preempt if short, one prefill step (if any request is
        prefilling) or one decode step, finish what is done."""
        self._admit()
        self._preempt()
        self.clock += 1
        R = self.config.max_requests
        rows = [r for r in self.running if not r.done]
        if not rows:
            return
        prefill = any(r.pos < len(r.prompt) for r in rows)  # then decode rows ride along, 1 token each
        T = self.chunk if prefill else 1
        tokens = np.zeros((R, T), np.int32)
        counts = np.zeros(R, np.int32)
        positions = np.zeros(R, np.int32)
        for slot, held in self.snapshot_of.items():
            positions[slot] = len(held)
        for r in self.running:
            positions[r.slot] = r.pos
        for r in rows:
            feed = r.prompt[r.pos : r.pos + T] if r.pos < len(r.prompt) else r.out[-1:]
            tokens[r.slot, : len(feed)] = feed
            counts[r.slot] = len(feed)
        self.state, nxt = _forward(
            self.model, self.state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(counts), chunk=T
        )
        nxt = np.asarray(nxt)  # the sampled tokens: a server reads them every step
        for r in rows:
            prefilling = r.pos < len(r.prompt)
            r.pos += int(counts[r.slot])
            if prefilling:
                self.prefilled += int(counts[r.slot])
            if r.pos >= len(r.prompt):
                r.out.append(int(nxt[r.slot]))
            elif self.share and r.pos % self.chunk == 0:
                self._snapshot(r)
        for r in [r for r in self.running if r.done]:
            self.state = H.finish(self.state, jnp.asarray([r.slot], jnp.int32))
            self.free.append(r.slot)
            self.running.remove(r)
        used, named = H.block_counts(self.state)
        self.history.append(dict(blocks_used=used, blocks_named=named, running=len(self.running), prefill=prefill))

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running or self.swapped):
                return
            self.step()
        raise RuntimeError(f"max_steps: {max_steps} steps did not finish the workload")

    @property
    def hit_rate(self) -> float:
        """Prompt tokens taken from snapshots over all prompt tokens."""
        return self.hit_tokens / max(self.prompt_tokens, 1)


def shared_prefix_workload(requests: int, prompts: int, shared: int, unique: int, vocab: int, seed: int = 0):
    """``requests`` prompts: one of ``prompts`` shared stems of ``shared`` tokens (in turn),
    then ``unique`` tokens of their own."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, vocab, shared) for _ in range(prompts)]
    return [np.concatenate([stems[i % prompts], rng.integers(0, vocab, unique)]).tolist() for i in range(requests)]


def small_model(max_requests: int = 24, max_context: int = 512, pool_tokens: int | None = None, seed: int = 0):
    """A CPU-sized model: 4 layers (SWA, CSA 4, HCA 16, CSA 4), width 64, 2 heads."""
    cache = H.HybridConfig(
        compress_ratios=(0, 4, 16, 4),
        window=16,
        index_heads=4,
        top_k=32,
        block_size=8,
        max_requests=max_requests,
        max_context=max_context,
        pool_tokens=pool_tokens,
        original_seq_len=max_context,
    )
    cfg = V4AttentionConfig(cache=cache, dim=64, num_heads=2, q_lora_rank=32, o_groups=2, o_lora_rank=16)
    return V4Stack(cfg, vocab=256, rngs=nnx.Rngs(seed))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--shared", type=int, default=256)
    ap.add_argument("--unique", type=int, default=32)
    ap.add_argument("--new", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--every", type=int, default=2, help="steps between arrivals")
    args = ap.parse_args(argv)
    rows = []
    for share in (False, True):
        server = Server(small_model(), args.chunk, share=share)
        for i, p in enumerate(shared_prefix_workload(args.requests, args.prompts, args.shared, args.unique, 256)):
            server.submit(p, args.new, arrival=i * args.every)
        server.run()
        peak = max(h["blocks_used"] for h in server.history)
        rows.append((share, len(server.history), server.prefilled, peak, server.hit_rate, server.preemptions))
    print("| prefix sharing | steps | prompt tokens computed | peak blocks | hit rate | preemptions |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for share, steps, pre, peak, hit, pre_n in rows:
        print(f"| {'on' if share else 'off'} | {steps} | {pre} | {peak} | {hit:.2f} | {pre_n} |")
    return rows


if __name__ == "__main__":
    main()

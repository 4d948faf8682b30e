"""A drop-in for lingbot-map's ``FlashInferKVCacheManager`` whose buffers are jaxkv's.

Same constructor arguments, methods and attributes as lingbot-map's manager, so an
aggregator switches by changing an import (``use_in_lingbot_map()`` does it for
upstream's model). Underneath:

* The K/V buffers are a ``jaxkv.frame.FrameCacheState``'s (one page structure for every
  block). jaxkv's bookkeeping of the page structure is queued and replayed on the device
  in batches (``pages.ReplayQueue``), or when ``state`` is read.
* torch writes the K/V through zero-copy views of every buffer, taken once for the
  buffers' lifetime (``_take_views``): on CUDA each ``append_frame`` is one call of
  ``jaxkv/cuda/frame_append.cu`` (finiteness check + scatter, two launches; torch ops where it
  cannot be built), layout row moves are slice copies. The rows come from a host mirror of
  the page structure (``pages.Pages``, jaxkv's ``frame.plan`` rules on Python ints; a test
  holds it equal to the device's), so nothing is read from the device and JAX never writes K/V.
* With exact pages the visible keys of every block are ONE contiguous prefix, rows
  ``[0, n)`` of each ``[T, H, D]`` buffer, ``n`` known on the host
  (``Pages.visible_rows`` = ``FrameCacheState.num_valid``). Attention: ``backend=``
  ``"sdpa"``, ``"cuda"``, ``"flashinfer"``, ``"flashinfer-paged-fa2"`` or
  ``"flashinfer-paged-fa3"`` (``torch_bridge.backends``), or ``"auto"``, chosen by
  ``jaxkv._backend`` (operation ``torch.attention``: sdpa on a CPU; on CUDA by the frame's
  token count, or paged FA3 with ``fa3=True`` as lingbot-map does). Pages are power-of-two
  only under ``"flashinfer-paged-fa3"``; every other backend gets exact pages, so a prefix
  backend never sees padding.

Differences from lingbot-map's manager, all deliberate:
* Blocks share one page structure. A block that falls behind (the scale phase appends
  every frame to block 0 before block 1) writes each frame into the rows where that
  frame's tokens are now; a block's attention reads the shared structure.
* Eviction happens inside ``append_frame`` (``evict_frames`` only checks its arguments,
  and refuses flags it does not implement). So ``rollback_last_frame`` needs the frame to
  have been appended with ``_defer_eviction = True`` (keyframe selection does exactly
  that); otherwise it raises.
* Special capacity grows on demand (``max_total_frames`` is the initial size), instead
  of an ``assert`` when it runs out.
* Bad input (a tensor on another device, of an integer dtype or of the wrong shape, a
  block index out of range, an unsupported flag) is a ``ValueError`` naming the argument,
  and leaves the cache unchanged. k, v and q of another float dtype are cast to the
  storage dtype (upstream appends float32 k under autocast).

Ownership: jaxkv allocates every buffer and its layout decides every row; torch writes and
reads K/V through views, on torch's current stream. JAX reads them only in ``save`` and
when the special capacity grows, each after a stream sync; JAX frees or reuses a buffer as
soon as its last view goes, so the views go (grow, restore, the manager's end) only after
torch's queued work on them has run. See docs/torch.md.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxkv import _backend, checkpoint, frame
from jaxkv.errors import Fault, record
from jaxkv.errors import check as _check
from jaxkv.frame import plan
from jaxkv.frame.state import NONE, STAGED
from torch_bridge import backends, fp8, kernels
from torch_bridge.dlpack import from_torch, to_torch
from torch_bridge.pages import BEGIN, RESOLVE, Pages, ReplayQueue


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 as its bytes: torch's copies and scatters do not all take float8 dtypes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class FlashInferKVCacheManager:
    """Two-stream paged KV cache (pinned scale pages, a sliding window of patch pages,
    append-only specials) over jaxkv buffers. Arguments as lingbot-map's manager:

    num_blocks: transformer blocks (one K and one V buffer each).
    max_num_frames: accepted for compatibility (capacity follows scale_frames + sliding_window).
    tokens_per_frame: specials + patches per frame (e.g. 262 = 6 + 256).
    num_heads, head_dim: KV heads (= query heads) and their width.
    dtype: storage dtype (float32 becomes bfloat16 unless ``force_fp32``).
    device: where the buffers live (a CUDA device for FlashInfer).
    num_special_tokens, scale_frames, sliding_window: the cache's policy.
    max_total_frames: initial special capacity in frames (grows on demand).
    force_fp32: float32 storage and float32 attention ("sdpa").
    fa3: with ``backend="auto"`` on CUDA with FlashInfer, lingbot-map's paged FA3 path
      (power-of-two pages); an explicit ``backend`` overrides it.
    backend: keyword only; ``"auto"``, ``"sdpa"``, ``"cuda"``, ``"flashinfer"``,
      ``"flashinfer-paged-fa2"`` or ``"flashinfer-paged-fa3"`` (``torch_bridge.backends``;
      chosen and checked by ``jaxkv._backend``'s ``torch.attention``). ``self.backend`` is
      the one in use.
    """

    def __init__(
        self,
        num_blocks: int,
        max_num_frames: int,
        tokens_per_frame: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        num_special_tokens: int = 6,
        scale_frames: int = 8,
        sliding_window: int = 64,
        max_total_frames: int = 2048,
        force_fp32: bool = False,
        fa3: bool = False,
        *,
        backend: str = "auto",
    ):
        patches = tokens_per_frame - num_special_tokens
        if patches <= 0:
            raise ValueError(
                f"tokens_per_frame: expected more than num_special_tokens={num_special_tokens}, got {tokens_per_frame}"
            )
        self.force_fp32 = force_fp32
        if dtype == torch.float8_e4m3fn and force_fp32:
            raise ValueError("dtype: torch.float8_e4m3fn storage attends in bfloat16; force_fp32 asks for float32")
        dtype = torch.float32 if force_fp32 else (torch.bfloat16 if dtype == torch.float32 else dtype)
        if dtype not in backends.DTYPES:
            raise ValueError(f"dtype: expected torch.bfloat16, float16, float32 or float8_e4m3fn, got {dtype}")
        self.dtype = dtype  # the storage dtype
        # FP8 storage: K/V come in, are attended and come out as bfloat16
        self.compute_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means the current CUDA device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.backend = _backend.choose(
            "torch.attention",
            backend,
            **backends.backend_context(
                device, dtype, head_dim, force_fp32=force_fp32, fa3=fa3, tokens_per_frame=tokens_per_frame
            ),
        )
        self.num_blocks = num_blocks
        self.num_heads, self.head_dim = num_heads, head_dim
        self.tokens_per_frame = tokens_per_frame
        self.num_special_tokens = num_special_tokens
        self.patches_per_frame = patches
        self.scale_frames, self.sliding_window = scale_frames, sliding_window
        self.max_num_frames = max_num_frames
        self.fa3 = fa3
        spec = frame.FrameSpec(
            num_layers=num_blocks,
            num_heads=num_heads,
            head_dim=head_dim,
            patches_per_frame=patches,
            num_special=num_special_tokens,
            scale_frames=scale_frames,
            sliding_window=sliding_window,
            max_frames=max(1, max_total_frames),
            dtype=backends.DTYPES[dtype],
            pow2_pages=self.backend == "flashinfer-paged-fa3",
        )
        self.page_size = spec.page_size
        self.max_patch_pages = spec.num_slots
        self._jax_device = self._jax_device_for(self.device)
        self._queue = ReplayQueue()  # jaxkv's bookkeeping not yet replayed on the device (``_bookkeep``)
        self._reads_state = None  # an event after torch's last read of the state's metadata
        with jax.default_device(self._jax_device):
            self.state = frame.init(spec)
        self._take_views()
        self._pages = Pages(spec)
        self._arange_ns = torch.arange(num_special_tokens, device=self.device)
        self._arange_ps = torch.arange(spec.page_size, device=self.device)
        self.frame_count: list[int] = [0] * num_blocks
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)  # sticky: a NaN / Inf frame came
        # CUDA: jaxkv/cuda/frame_append.cu writes a frame (finiteness check + scatter: 2 launches);
        # else (CPU, or no nvcc to build it) the same rule in torch ops
        self._append_scratch = (
            torch.empty(kernels.APPEND_SCRATCH, dtype=torch.int32, device=self.device)
            if kernels.frame_append_available(self.device)
            else None
        )
        self._frame_open = False  # the shared frame's write rows are valid
        self._defer_eviction: bool = False
        self._attention = backends.make(
            self.backend,
            device=self.device,
            jax_device=self._jax_device,
            heads=num_heads,
            head_dim=head_dim,
            dtype=self.compute_dtype,
            page_size=self.page_size,
            tokens_per_frame=tokens_per_frame,
        )
        if isinstance(self._attention, backends.FlashInferPaged):  # the attributes of lingbot-map's manager
            self.workspace_buffer = self._attention.workspace
            self.prefill_wrapper = self._attention.wrapper

    @staticmethod
    def _jax_device_for(device: torch.device):
        if device.type == "cuda":
            gpus = [d for d in jax.devices() if d.platform == "gpu"]
            if not gpus:
                raise ValueError(f"device: {device} requested but jax sees no GPU")
            return gpus[device.index or 0]
        return jax.devices("cpu")[0]

    @property
    def state(self) -> frame.FrameCacheState:
        """The jaxkv frame cache (its bookkeeping brought up to date: one dispatch at most)."""
        self._flush()
        return self._state

    @state.setter
    def state(self, value: frame.FrameCacheState):
        self._state = value

    @property
    def spec(self) -> frame.FrameSpec:
        return self._state.spec

    # ---------------------------------------------------------------- checks
    def _block(self, block_idx) -> int:
        if (
            isinstance(block_idx, bool)
            or not isinstance(block_idx, (int, np.integer))
            or not 0 <= block_idx < self.num_blocks
        ):
            raise ValueError(f"block_idx: expected an int in [0, {self.num_blocks}), got {block_idx!r}")
        return int(block_idx)

    def _tensor(self, name, x, want):
        """``x`` checked (shape ``want``, a None entry: any; this device; a float dtype) and
        cast to the storage dtype."""
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
        if shape is None or len(shape) != len(want) or any(w is not None and w != g for w, g in zip(want, shape)):
            got = shape if isinstance(x, torch.Tensor) else type(x).__name__
            dims = ", ".join("q_len" if w is None else str(w) for w in want)
            raise ValueError(f"{name}: expected a tensor of shape [{dims}] ([tokens, H, D], specials first), got {got}")
        if x.device != self.device:
            raise ValueError(f"{name}: expected device {self.device}, got {x.device}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating-point tensor (cast to {self.compute_dtype}), got {x.dtype}")
        return x.to(self.compute_dtype)

    def _frame_tensor(self, name, x):
        x = self._tensor(name, x, (self.tokens_per_frame, self.num_heads, self.head_dim))
        pad = self.page_size - self.patches_per_frame
        if pad:  # a power-of-two page's padding rows are written as zeros
            x = torch.cat([x, x.new_zeros(pad, self.num_heads, self.head_dim)])
        return x

    # ---------------------------------------------------------------- buffers and bookkeeping
    def _take_views(self):
        """torch views of every K/V buffer ([T, H, D]) and their paged form, for the
        buffers' lifetime (JAX never writes them, so never donates them)."""
        s = self.spec
        self._k = [to_torch(x)[0] for x in self._state.k]
        self._v = [to_torch(x)[0] for x in self._state.v]
        self._k_scale = [to_torch(x)[0] for x in self._state.k_scale]  # FP8: bf16[T, H]; else none
        self._v_scale = [to_torch(x)[0] for x in self._state.v_scale]
        rows = s.max_pages * s.page_size
        shape = (s.max_pages, s.page_size, self.num_heads, self.head_dim)
        self._paged = [(k[:rows].view(shape), v[:rows].view(shape)) for k, v in zip(self._k, self._v)]

    def _bookkeep(self, kind: int, flag: bool):
        """Queue jaxkv's bookkeeping of a frame (``BEGIN``) or a decision (``RESOLVE``),
        replayed on the device when the queue is full or ``state`` is read."""
        if self._queue.push(kind, flag):
            self._flush()

    def _flush(self):
        if self._queue.calls and self._reads_state is not None:
            self._reads_state.synchronize()  # a lagging block's torch ops read token_id: done first
            self._reads_state = None
        self._state = self._queue.apply(self._state, self._jax_device)

    def _torch_mark(self):
        """A CUDA event at this point of torch's stream (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _drain(self):
        """Wait for torch's queued work on this cache's buffers: before JAX reads them (save,
        grow), and before their last views go, since JAX frees or reuses a buffer the moment
        nothing references it, whatever torch's stream has yet to run (a view dropped early
        lets the next allocation write under it)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def __del__(self):
        cuda = getattr(torch, "cuda", None)  # None while the interpreter shuts down
        if getattr(self, "_k", None) and cuda is not None and cuda.is_initialized():
            self._drain()

    def _apply_moves(self, moves):
        """Make the layout's row moves (``(src, dst)``, ``page_size`` rows) in every K/V buffer."""
        ps = self.page_size
        bufs = [_raw(b) for b in (*self._k, *self._v, *self._k_scale, *self._v_scale)]
        for src, dst in moves:  # one foreach copy over every buffer: a few launches, not 2 per block
            torch._foreach_copy_([b[dst : dst + ps] for b in bufs], [b[src : src + ps] for b in bufs])

    # ---------------------------------------------------------------- public API
    def append_frame(self, block_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one frame's K/V ([tokens_per_frame, H, D], specials first) to ``block_idx``.

        K or V holding a NaN or an Inf (after the cast to the cache's dtype) is written to
        the trash rows instead, and ``check()`` raises ``NONFINITE_KV`` from then on (as
        ``jaxkv.frame.write_layer``; decided on the device, no host sync)."""
        b = self._block(block_idx)
        k, v = self._frame_tensor("k", k), self._frame_tensor("v", v)
        n, p = self.frame_count[b], self._pages
        if n == p.frames:  # this block leads: start the shared frame
            if p.pending != NONE:
                raise RuntimeError(
                    "append_frame: the previous frame was deferred and is neither committed "
                    "(execute_deferred_eviction) nor rolled back (rollback_last_frame)"
                )
            self._make_room()
            defer = bool(self._defer_eviction)
            moves, special_row, patch_row = p.begin(defer)
            self._apply_moves(moves)
            self._rows = torch.cat((self._arange_ns + special_row, self._arange_ps + patch_row))
            self._frame_open = True
            self._bookkeep(BEGIN, defer)
        if n == p.frames - 1 and self._frame_open:
            if self._append_scratch is not None and not self._k_scale:
                kernels.frame_append(
                    k.contiguous(),
                    v.contiguous(),
                    self._k[b],
                    self._v[b],
                    self._rows,
                    self.spec.trash_row,
                    self._append_scratch,
                    self._nonfinite,
                )
            else:
                rows = torch.where(self._finite(k, v), self._rows, self.spec.trash_row)
                for buf, x in self._stored(b, k, v):
                    buf.index_copy_(0, rows, x)
        else:  # a lagging block: its frame n goes where that frame's tokens are now
            ok = self._finite(k, v)
            tid = to_torch(self.state.token_id)[0]
            tpf = self.tokens_per_frame
            hit = (tid >= 0) & (tid // tpf == n) & ok
            src = (tid % tpf).clamp(0, tpf - 1).to(torch.int64)
            for buf, x in self._stored(b, k, v):
                buf.copy_(torch.where(hit.view(-1, *[1] * (buf.dim() - 1)), x[src], buf))
            self._reads_state = self._torch_mark()  # the next replay reuses token_id's memory
        self.frame_count[b] += 1

    def _stored(self, b: int, k, v):
        """(buffer, rows to write into it) for block ``b``'s buffers: k and v as they are, or
        an FP8 cache's codes and scales (``torch_bridge.fp8``)."""
        if not self._k_scale:
            return ((self._k[b], k), (self._v[b], v))
        (kq, ks), (vq, vs) = fp8.quantize_rows(k), fp8.quantize_rows(v)
        pairs = ((self._k[b], kq), (self._v[b], vq), (self._k_scale[b], ks), (self._v_scale[b], vs))
        return tuple((_raw(buf), _raw(x)) for buf, x in pairs)

    def _finite(self, k, v):
        """bool[] on the device: k and v hold no NaN / Inf (and the sticky flag records it)."""
        ok = torch.isfinite(k).all() & torch.isfinite(v).all()
        self._nonfinite |= ~ok
        return ok

    def _make_room(self):
        s = self.spec
        if (self._pages.frames + 1) * s.num_special > s.special_capacity:
            self._drain()  # torch's writes land before JAX copies; the old views go below
            self.state = frame.grow(self.state, 2 * s.max_frames)
            self._take_views()

    def evict_frames(
        self,
        block_idx: int,
        scale_frames: int,
        sliding_window: int,
        cross_frame_special: bool = True,
        include_scale_frames: bool = True,
        camera_only: bool = False,
        num_register_tokens=None,
    ) -> None:
        """Eviction already happened in ``append_frame`` (or waits for the deferred
        decision); this checks that the policy is the cache's.

        Upstream's SDPA path implements ``cross_frame_special=False``,
        ``include_scale_frames=False`` and ``camera_only=True`` (its FlashInfer manager
        ignores them); this cache keeps every frame's specials and the scale frames, so
        those values are a ``ValueError``, as is a ``num_register_tokens`` other than the
        cache's (``num_special_tokens - 2``: camera + registers + scale; None: the cache's).
        """
        self._block(block_idx)
        self._check_policy(
            scale_frames,
            sliding_window,
            cross_frame_special=cross_frame_special,
            include_scale_frames=include_scale_frames,
            camera_only=camera_only,
            num_register_tokens=num_register_tokens,
        )

    def _check_policy(self, scale_frames, sliding_window, **flags):
        if (scale_frames, sliding_window) != (self.scale_frames, self.sliding_window):
            raise ValueError(
                f"scale_frames, sliding_window: the cache was built with ({self.scale_frames}, "
                f"{self.sliding_window}), got ({scale_frames}, {sliding_window})"
            )
        supported = dict(
            cross_frame_special=True,
            include_scale_frames=True,
            camera_only=False,
            num_register_tokens=self.num_special_tokens - 2,
        )
        for name, value in flags.items():
            if name == "num_register_tokens" and value is None:
                continue
            if name not in supported:
                raise ValueError(f"{name}: not an eviction flag of this manager (known: {sorted(supported)})")
            if value != supported[name]:
                raise ValueError(
                    f"{name}: this manager implements only {name}={supported[name]!r} "
                    f"(every frame's {self.num_special_tokens} specials and the scale frames are "
                    f"kept), got {value!r}"
                )

    def execute_deferred_eviction(self, block_idx: int, scale_frames: int, sliding_window: int, **kwargs) -> None:
        """Keep the deferred frame (evict the oldest window frame if over the window);
        done once for all blocks, at the first block's call. ``kwargs``: ``evict_frames``'s
        flags, checked the same way."""
        self._block(block_idx)
        self._check_policy(scale_frames, sliding_window, **kwargs)
        if self._pages.pending != NONE:
            self._resolve_frame(True)

    def rollback_last_frame(self, block_idx: int) -> None:
        """Undo the most recent ``append_frame`` of ``block_idx`` (its patches, specials and
        count); the frame must have been appended with ``_defer_eviction = True``."""
        b = self._block(block_idx)
        n, p = self.frame_count[b], self._pages
        if n == 0:
            raise ValueError(f"rollback_last_frame: block {b} has no frame to roll back")
        if n == p.frames:
            if p.pending == NONE:
                raise RuntimeError(
                    f"rollback_last_frame: block {b}'s last frame was appended without "
                    "_defer_eviction = True, so its eviction already happened; set "
                    "_defer_eviction = True before append_frame to be able to roll back"
                )
            self._resolve_frame(False)
        elif n != p.frames + 1:
            raise RuntimeError(
                f"rollback_last_frame: block {b} is at frame {n} but the cache at {p.frames}: "
                "only the last frame can be rolled back"
            )
        self.frame_count[b] -= 1

    def _resolve_frame(self, keep: bool):
        self._apply_moves(self._pages.resolve(keep))
        self._bookkeep(RESOLVE, keep)
        self._frame_open = False

    def compute_attention(self, block_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Non-causal attention of ``q`` ([q_len, H, D]) over what block ``block_idx``'s
        cache shows -> [q_len, H, D] in the storage dtype (bfloat16 for FP8 storage;
        ``force_fp32``: q's dtype, as lingbot-map's manager). No host sync, no DLPack: the
        backends read the views ``_take_views`` made."""
        b = self._block(block_idx)
        x = self._tensor("q", q, (None, self.num_heads, self.head_dim))
        if self.frame_count[b] == 0:
            return torch.zeros_like(q)
        out = self._attend(b, x)
        return out.to(q.dtype) if self.force_fp32 else out

    def _attend(self, b: int, q: torch.Tensor) -> torch.Tensor:
        if not self._k_scale:
            return self._attention(q, self._k[b], self._v[b], self._paged[b], self._pages)
        if self._attention.reads_fp8:  # the codes and scales in place
            scales = (self._k_scale[b], self._v_scale[b])
            return self._attention(q, self._k[b], self._v[b], None, self._pages, scales=scales)
        # FP8 elsewhere: the visible rows [0, n) dequantized to one bf16 copy per call (a prefix
        # backend reads only those rows); docs/kernels/frame_cache_fp8.md
        n = self._pages.visible_rows()
        k = fp8.dequantize_rows(self._k[b][:n], self._k_scale[b][:n])
        v = fp8.dequantize_rows(self._v[b][:n], self._v_scale[b][:n])
        return self._attention(q, k, v, None, self._pages)

    def reset(self) -> None:
        """Empty the cache for a new sequence."""
        self._queue.clear()  # a reset supersedes them
        self.state = frame.reset(self._state)
        self._nonfinite.zero_()
        self._pages.reset()
        self.frame_count = [0] * self.num_blocks
        self._frame_open = False
        self._attention.reset()

    # ---------------------------------------------------------------- durable state
    def state_dict(self) -> dict:
        """The cache as a torch state dict: each jaxkv state array as a tensor (a copy) under
        ``"state" + its key path`` (``jaxkv.checkpoint.leaves``'s names), the per-block frame
        counts under ``"frame_count"``, the spec as JSON under ``"spec"``."""
        out = {f"state{k}": to_torch(x).clone() for k, x in checkpoint.leaves(self._faults_in_state()).items()}
        self._drain()  # the clones read JAX arrays that the next replay reuses
        out["frame_count"] = torch.tensor(self.frame_count, dtype=torch.int64)
        out["spec"] = json.dumps(checkpoint.spec_to_json(self.spec))
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from ``state_dict()``'s output, which must come from a manager of the same
        spec (``ValueError`` naming what differs); nothing changes on a refusal."""
        spec = checkpoint.spec_from_json("frame", json.loads(state_dict.get("spec", "{}")))
        if spec != self.spec:
            diff = [
                f"{k}={getattr(spec, k)!r} (this manager: {v!r})"
                for k, v in dataclasses.asdict(self.spec).items()
                if getattr(spec, k) != v
            ]
            raise ValueError("state_dict: its spec differs from this manager's: " + ", ".join(diff))
        names = list(checkpoint.leaves(self._state))
        missing = [f"state{k}" for k in names if f"state{k}" not in state_dict]
        if missing or "frame_count" not in state_dict:
            raise ValueError(f"state_dict: missing {(missing + ['frame_count'])[:4]}")
        counts = [int(c) for c in state_dict["frame_count"]]
        if len(counts) != self.num_blocks:
            raise ValueError(f"state_dict: frame_count for {len(counts)} blocks, this manager has {self.num_blocks}")
        like = checkpoint.leaves(self._state)
        arrays = []
        for k in names:
            t = state_dict[f"state{k}"].to(self.device).contiguous()
            x = jnp.array(from_torch(t), copy=True)  # the manager owns its buffers
            if x.shape != like[k].shape or x.dtype != like[k].dtype:
                raise ValueError(
                    f"state_dict: state{k} is {x.dtype}{list(x.shape)}, expected {like[k].dtype}{list(like[k].shape)}"
                )
            arrays.append(x)
        self._adopt(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self._state), arrays), counts)

    def _adopt(self, state: frame.FrameCacheState, counts: list[int]) -> None:
        """Continue from ``state`` (checked) with per-block frame counts ``counts``."""
        self._queue.clear()
        self._drain()  # the old buffers go with their views
        self.state = state
        self._nonfinite.zero_()  # the faults are the loaded state's
        self._take_views()
        # the host mirror from the device counters: a load, not a step
        self._pages.load(plan.Counters(*(int(x[0]) for x in plan.counters(state))))
        self.frame_count = counts
        self._frame_open = False
        self._attention.reset()

    def save(self, path) -> None:
        """``jaxkv.save`` of the cache, with the per-block frame counts beside it."""
        self._drain()  # JAX reads the buffers: torch's writes land first
        path = checkpoint.save(path, self._faults_in_state())
        (path / "frame_count.json").write_text(json.dumps(self.frame_count))

    def restore(self, path) -> None:
        """Continue from ``save``'s directory (a checkpoint of a manager of the same spec)."""
        counts = [int(c) for c in json.loads((Path(path) / "frame_count.json").read_text())]
        if len(counts) != self.num_blocks:
            raise ValueError(f"path: frame counts for {len(counts)} blocks, this manager has {self.num_blocks}")
        self._adopt(checkpoint.restore(path, like=self._state), counts)

    # ---------------------------------------------------------------- views
    def build_visible_page_table(self, block_idx: int) -> list[int]:
        """Visible page ids in scale -> window -> special order (reads the device: for
        inspection, not for the per-frame step)."""
        self._block(block_idx)
        return np.asarray(frame.page_table(self.state).indices[0, : self._pages.num_pages()]).tolist()

    def get_cache_stats(self, block_idx: int = 0) -> dict:
        """Occupancy for one block from the host mirror (no device read), upstream's keys:

        frame_count: frames appended to the block (minus rollbacks)
        scale_pages: scale patch pages held
        live_pages: window patch pages held (W + 1 while a deferred frame waits, as upstream)
        free_pages: free patch slots (S + W in all; upstream's pool has 16 pages more)
        special_tokens: special tokens written for the block

        Pages are shared by all blocks: a block still appending the scale phase's frames
        reports the shared scale/window counts.
        """
        b = self._block(block_idx)
        p = self._pages
        return {
            "frame_count": self.frame_count[b],
            "scale_pages": p.num_scale,
            "live_pages": p.num_window + int(p.pending == STAGED),
            "free_pages": self.spec.num_slots - p.num_scale - p.num_window,
            "special_tokens": self.frame_count[b] * self.num_special_tokens,
        }

    def compute_last_page_len(self, block_idx: int) -> int:
        """Valid rows of the last visible page (host bookkeeping, no sync)."""
        self._block(block_idx)
        return self._pages.last_page_len()

    @property
    def num_frames(self) -> int:
        """Frames appended to block 0 (lingbot-map's manager's representative count)."""
        return self.frame_count[0] if self.frame_count else 0

    @property
    def scale_patch_pages(self) -> list[list[int]]:
        return [self.build_visible_page_table(0)[: self._pages.num_scale]] * self.num_blocks

    @property
    def live_window_patch_pages(self) -> list[list[int]]:
        p = self._pages
        return [self.build_visible_page_table(0)[p.num_scale : p.num_scale + p.num_window]] * self.num_blocks

    @property
    def all_special_pages(self) -> list[list[int]]:
        p = self._pages
        return [self.build_visible_page_table(0)[p.num_scale + p.num_window :]] * self.num_blocks

    @property
    def special_token_count(self) -> list[int]:
        return [n * self.num_special_tokens for n in self.frame_count]

    def check(self) -> None:
        """Raise ``jaxkv.errors.CacheError`` if the device recorded a fault (a host sync)."""
        _check(self._faults_in_state())

    def _faults_in_state(self) -> frame.FrameCacheState:
        """``state`` with the faults torch recorded (non-finite K/V) in its error field (a host sync)."""
        st = self.state
        return st.replace(error=record(st.error, jnp.asarray(bool(self._nonfinite)), Fault.NONFINITE_KV))


__all__ = ["FlashInferKVCacheManager"]

"""Deterministic streams for the checkpoint tests: the same frames / tokens whether a run is
whole or cut by a save and continued in another process (``python streams.py ...``). Every
run is its own fresh process, started alike: on a GPU, XLA picks its GEMM algorithms per
process by timing them, so two processes agree bit for bit only with autotuning off."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import checkpoint, frame
from jaxkv import hybrid as H

FRAME_SPEC = frame.FrameSpec(
    num_layers=2,
    num_heads=2,
    head_dim=16,
    patches_per_frame=6,
    num_special=2,
    scale_frames=1,
    sliding_window=3,
    max_frames=16,
    dtype="bfloat16",
)
HYBRID = H.HybridConfig(
    compress_ratios=(0, 4, 128), window=16, index_heads=2, top_k=8, block_size=8, max_requests=2, max_context=512
)


def frame_run(state, t0: int, t1: int):
    """Frames [t0, t1): resolve the pending frame (keep on even t), append (deferred when
    t % 3 == 2), attend every layer. -> (state, outputs f32[t1 - t0, L, B, tokens, H, D])."""
    s = state.spec
    outs = []
    for t in range(t0, t1):
        rng = np.random.default_rng(1000 + t)
        if t > 0 and (t - 1) % 3 == 2:  # the previous frame was deferred
            state = frame.resolve(state, t % 2 == 0)
        shape = (s.num_layers, s.num_streams, s.tokens_per_frame, s.num_heads, s.head_dim)
        k, v, q = (jnp.asarray(rng.normal(size=shape), s.jnp_dtype) for _ in range(3))
        state = frame.append(state, k, v, defer=t % 3 == 2)
        outs.append(jnp.stack([frame.attention(state, l, q[l], impl="xla") for l in range(s.num_layers)]))
    return state, np.asarray(jnp.stack(outs).astype(jnp.float32))


def hybrid_run(state, t0: int, t1: int):  # noqa: D401
    """Decode tokens [t0, t1) for both request slots. -> (state, {layer: f32[t1 - t0, B, 1, H, D]})."""
    import hybrid_driver as D

    c = state.config
    params = D.make_params(c, np.random.default_rng(7))
    outs = []
    for t in range(t0, t1):
        x = D.make_inputs(c, np.random.default_rng(2000 + t), c.max_requests, 1)
        state, step = H.prepare_forward(
            state, jnp.arange(c.max_requests, dtype=jnp.int32), jnp.full((c.max_requests,), t, jnp.int32), chunk=1
        )
        state, o, _ = D.model_step(state, step, x, params)
        outs.append(np.stack([np.asarray(o[l], np.float32) for l in range(c.num_layers)]))
    return state, np.stack(outs)


def leaves(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def as_bytes(x) -> np.ndarray:
    """The array's bytes (npz cannot hold bf16)."""
    return np.ascontiguousarray(x).view(np.uint8)


def main(kind: str, mode: str, path: str, t0: int, t1: int, out: str) -> None:
    """mode "whole": run [0, t1); "part": run [0, t1) and save to ``path``; "continue":
    restore ``path`` and run [t0, t1). Writes the outputs and the final state to ``out``."""
    run = frame_run if kind == "frame" else hybrid_run
    if mode == "continue":
        state = checkpoint.restore(path)
    else:
        state = (
            frame.init(FRAME_SPEC)
            if kind == "frame"
            else H.init(dataclasses.replace(HYBRID, storage=kind.split(":")[1]))
        )
    state, outs = run(state, t0, t1)
    if mode == "part":
        checkpoint.save(path, state)
    np.savez(
        out,
        outputs=outs,
        pending=np.asarray(getattr(state, "pending", np.zeros(1))),
        **{f"leaf{i}": as_bytes(x) for i, x in enumerate(leaves(state).values())},
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])

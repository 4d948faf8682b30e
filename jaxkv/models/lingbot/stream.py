"""LingbotStream: a video through ``LingbotMap``, one jitted call per frame, caches donated.

Upstream's ``inference_streaming`` order: the first ``num_scale_frames`` frames together,
then one frame per call; with ``keyframe_interval`` N > 1 only every N-th frame after the
scale frames stays in the caches. Which frames are keyframes is known on the host, so the
driver also bounds the frame count before a cache could overflow, without a device read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.flax import CachedStep
from jaxkv.models.lingbot.model import LingbotMap


def _frame_step(model, images, keyframe=True, *, phase):
    """The model's step; a streamed frame's outputs without the frame axis (sliced in the jit)."""
    out = model(images, keyframe, phase=phase)
    return out if phase == "scale" else {k: v[:, 0] for k, v in out.items()}


class LingbotStream:
    """``stream = LingbotStream(model); for out in stream.run(frames): ...``

    frames: arrays f32[H, W, 3] (one stream) or f32[B, H, W, 3], values in [0, 1].
    Each yielded dict holds one frame's predictions (device arrays, not synced):
    pose_enc [B, 9], depth [B, H, W, 1], depth_conf [B, H, W] (and the point head's).
    """

    def __init__(self, model: LingbotMap, keyframe_interval: int = 1):
        if keyframe_interval < 1:
            raise ValueError(f"keyframe_interval: expected an int >= 1, got {keyframe_interval}")
        self.model = model
        self.config = model.config
        self.keyframe_interval = keyframe_interval
        self.step = CachedStep(model, _frame_step, static_argnames=("phase",))

    def is_keyframe(self, index: int, interval: int | None = None) -> bool:
        """Frame ``index`` (0-based, counting the scale frames) stays in the caches."""
        s = self.config.num_scale_frames
        return index < s or (index - s) % (interval or self.keyframe_interval) == 0

    def _batch(self, frames: list, index: int, batch: int) -> jnp.ndarray:
        """frames ``index ..`` -> f32[B, S, H, W, 3]; each must be the model's [H, W, 3] (or
        [B, H, W, 3], with the stream's B): another size would be a new compile and a wrong
        number of tokens in the caches."""
        c = self.config
        want = (c.height, c.width, 3)
        for i, f in enumerate(frames, start=index):
            shape = tuple(np.shape(f))
            if len(shape) not in (3, 4) or shape[-3:] != want or (shape[:-3] or (1,)) != (batch,):
                b = f"[{batch}, " if batch > 1 else "["
                raise ValueError(
                    f"frames: frame {i} has shape {list(shape)}, expected {b}{c.height}, {c.width}, 3] "
                    "(LingbotConfig.height, width; the stream's first frames)"
                )
        x = np.stack([np.asarray(f, np.float32) for f in frames], axis=-4)  # [..., S, H, W, 3]
        if x.ndim == 4:
            x = x[None]
        return jnp.asarray(x)

    def run(self, frames: Iterable, keyframe_interval: int | None = None) -> Iterator[dict]:
        """A new video (the caches start empty); ``keyframe_interval`` overrides the stream's.

        When the generator finishes, the model holds the caches of the video's end."""
        if keyframe_interval is not None and keyframe_interval < 1:
            raise ValueError(f"keyframe_interval: expected an int >= 1, got {keyframe_interval}")
        try:
            yield from self._run(frames, keyframe_interval)
        finally:
            nnx.update(self.model, self.step.caches)

    def _run(self, frames, interval):
        c = self.config
        it = iter(frames)
        first = [f for _, f in zip(range(c.num_scale_frames), it)]
        if not first:
            return
        batch = (tuple(np.shape(first[0]))[:-3] or (1,))[0]  # the first frame's: [B, H, W, 3] or one stream
        out = self.step(self._batch(first, 0, batch), phase="scale")
        for s in range(len(first)):
            yield {k: v[:, s] for k, v in out.items()}
        keyframes, seen = len(first), len(first)
        for index, f in enumerate(it, start=len(first)):
            key = self.is_keyframe(index, interval)
            if keyframes + 1 > c.max_frame_num or seen + 1 > c.max_frame_num:
                raise ValueError(
                    f"frames: frame {index} would exceed max_frame_num={c.max_frame_num} "
                    f"({keyframes} keyframes, {seen} frames so far); build the model with a "
                    "larger LingbotConfig.max_frame_num"
                )
            out = self.step(self._batch([f], index, batch), jnp.asarray(key), phase="stream")
            keyframes += key
            seen += 1
            yield out

    def sync(self) -> LingbotMap:
        """The model with the stream's current caches (``CachedStep.sync``)."""
        return self.step.sync()

"""A synthetic video: a camera flying over a procedural textured ground, made in numpy.

No downloads: every frame is ray-cast from a pinhole camera onto the plane ``y = 0``
(a checkerboard, colour waves and seeded discs) under a sky gradient. The camera follows
a smooth curve and *hovers* for a few frames now and then, so keyframe selection has
frames to drop.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SyntheticVideo:
    frames: np.ndarray  # f32[F, H, W, 3] in [0, 1]
    positions: np.ndarray  # f32[F, 3] camera centres (x, y, z)
    yaw: np.ndarray  # f32[F] heading in radians
    moving: np.ndarray  # bool[F] whether the camera moved since the previous frame


def _trajectory(num_frames: int, hover_every: int, hover_len: int):
    """Arc length advances except during hovers; returns per-frame progress and moving flags."""
    moving = np.ones(num_frames, bool)
    if hover_every > 0:
        for start in range(hover_every, num_frames, hover_every + hover_len):
            moving[start : start + hover_len] = False
    moving[0] = False
    s = np.cumsum(moving).astype(np.float64)
    return s, moving


def synthetic_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    seed: int = 0,
    speed: float = 0.25,
    hover_every: int = 6,
    hover_len: int = 3,
    fov_deg: float = 70.0,
) -> SyntheticVideo:
    """Render ``num_frames`` frames of ``height`` x ``width`` pixels (see the module docstring)."""
    if num_frames < 1 or height < 1 or width < 1:
        raise ValueError(f"num_frames, height, width: expected positive ints, got {num_frames}, {height}, {width}")
    rng = np.random.default_rng(seed)
    discs = np.stack([rng.uniform(-30, 30, 24), rng.uniform(-5, 60, 24), rng.uniform(0.5, 2.5, 24)], -1)
    colors = rng.uniform(0.1, 1.0, (24, 3))

    s, moving = _trajectory(num_frames, hover_every, hover_len)
    yaw = 0.35 * np.sin(s * speed * 0.15)
    x = np.cumsum(np.sin(yaw) * speed * moving)
    z = np.cumsum(np.cos(yaw) * speed * moving)
    y = 1.6 + 0.2 * np.sin(s * speed * 0.3)
    positions = np.stack([x, y, z], -1)

    f = 0.5 * width / np.tan(np.radians(fov_deg) / 2)
    v, u = np.mgrid[0:height, 0:width].astype(np.float64)
    cam_dirs = np.stack([(u - width / 2 + 0.5) / f, -(v - height / 2 + 0.5) / f, np.ones_like(u)], -1)
    pitch = np.radians(30.0)  # looking down at the ground
    cp, sp = np.cos(pitch), np.sin(pitch)
    pitch_m = np.array([[1, 0, 0], [0, cp, -sp], [0, sp, cp]])

    frames = np.empty((num_frames, height, width, 3), np.float32)
    for i in range(num_frames):
        cy, sy = np.cos(yaw[i]), np.sin(yaw[i])
        yaw_m = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
        d = cam_dirs @ (yaw_m @ pitch_m).T
        down = d[..., 1] < -1e-6
        t = np.where(down, -positions[i, 1] / np.where(down, d[..., 1], -1.0), 0.0)
        gx, gz = positions[i, 0] + t * d[..., 0], positions[i, 2] + t * d[..., 2]
        checker = ((np.floor(gx) + np.floor(gz)) % 2)[..., None]
        waves = 0.5 + 0.5 * np.stack([np.sin(0.31 * gx), np.sin(0.23 * gz + 1), np.sin(0.17 * (gx + gz))], -1)
        ground = 0.35 * checker + 0.55 * waves
        dist2 = (gx[..., None] - discs[:, 0]) ** 2 + (gz[..., None] - discs[:, 1]) ** 2
        inside = dist2 < discs[:, 2] ** 2
        hit = np.argmax(inside, -1)
        ground = np.where(inside.any(-1)[..., None], colors[hit], ground)
        fog = np.exp(-0.02 * t)[..., None]
        sky = np.stack([0.55 + 0.3 * d[..., 1], 0.7 + 0.2 * d[..., 1], np.full_like(u, 0.95)], -1)
        frames[i] = np.where(down[..., None], fog * ground + (1 - fog) * sky, sky).clip(0, 1)
    return SyntheticVideo(
        frames=frames, positions=positions.astype(np.float32), yaw=yaw.astype(np.float32), moving=moving
    )

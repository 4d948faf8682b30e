"""Render examples/frames/*.png: a checkerboard floor and a patterned wall seen from a camera
sliding sideways (ray-plane intersection, numpy only). ``python examples/make_frames.py``.

8 frames of 112x84 pixels (width x height, multiples of the 14-pixel patch), for
``python -m jaxkv demo --lingbot --images examples/frames``.
"""

from __future__ import annotations

import pathlib

import numpy as np
from PIL import Image

WIDTH, HEIGHT, FRAMES = 112, 84, 8
FOCAL = 90.0  # pixels
CAM_HEIGHT = 1.0  # above the floor (y = 0)
WALL_Z = 5.0  # the wall is the plane z = WALL_Z, facing the camera


def render(cam_x: float) -> np.ndarray:
    """uint8[HEIGHT, WIDTH, 3]: the scene from a camera at (cam_x, CAM_HEIGHT, 0) looking along +z,
    tilted down a little."""
    u, v = np.meshgrid(np.arange(WIDTH) + 0.5 - WIDTH / 2, np.arange(HEIGHT) + 0.5 - HEIGHT / 2)
    d = np.stack([u / FOCAL, -v / FOCAL, np.ones_like(u)], -1)  # camera frame: x right, y up, z forward
    tilt = np.deg2rad(12.0)  # pitch down
    c, s = np.cos(tilt), np.sin(tilt)
    d = np.stack([d[..., 0], c * d[..., 1] - s * d[..., 2], s * d[..., 1] + c * d[..., 2]], -1)
    origin = np.array([cam_x, CAM_HEIGHT, 0.0])
    with np.errstate(divide="ignore", invalid="ignore"):
        t_floor = np.where(d[..., 1] < 0, -origin[1] / d[..., 1], np.inf)
        t_wall = np.where(d[..., 2] > 0, (WALL_Z - origin[2]) / d[..., 2], np.inf)
    img = np.empty((HEIGHT, WIDTH, 3))
    img[:] = (0.55, 0.7, 0.9)  # sky
    floor = t_floor < t_wall
    p = origin + d * np.where(floor, t_floor, t_wall)[..., None]
    # floor: 0.5 m checkerboard, darkening with distance
    check = (np.floor(p[..., 0] / 0.5) + np.floor(p[..., 2] / 0.5)) % 2
    shade = np.exp(-0.08 * np.nan_to_num(t_floor, posinf=0.0))[..., None]
    floor_rgb = np.where(check[..., None] > 0, (0.9, 0.85, 0.75), (0.25, 0.2, 0.2)) * shade
    # wall: coloured bricks with mortar lines
    row = np.floor(p[..., 1] / 0.3)
    brick_x = (p[..., 0] + 0.3 * (row % 2)) / 0.6
    mortar = (np.abs(brick_x - np.round(brick_x)) < 0.06) | (np.abs(p[..., 1] / 0.3 - np.round(p[..., 1] / 0.3)) < 0.08)
    hue = (np.floor(brick_x) * 7 + row * 3) % 5 / 5
    wall_rgb = np.stack([0.6 + 0.3 * hue, 0.3 + 0.2 * (1 - hue), 0.2 + 0.1 * hue], -1)
    wall_rgb = np.where(mortar[..., None], 0.8, wall_rgb)
    hit_wall = ~floor & np.isfinite(t_wall) & (p[..., 1] < 3.0)
    img = np.where(floor[..., None] & np.isfinite(t_floor)[..., None], floor_rgb, img)
    img = np.where(hit_wall[..., None], wall_rgb, img)
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


FRAMES_DIR = pathlib.Path(__file__).resolve().parent / "frames"


def main(out=FRAMES_DIR) -> None:
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(FRAMES):
        Image.fromarray(render(-0.6 + 0.15 * i)).save(out / f"frame_{i:03d}.png", optimize=True)


if __name__ == "__main__":
    main()

"""A refused restore leaves nothing running: no "Event loop is closed" traceback after it
(Orbax's in-flight reads end before its event loop closes; ``jaxkv.checkpoint._checkpointer``)."""

import asyncio
import time

import pytest

import jaxkv
from jaxkv import checkpoint as C
from jaxkv import frame

pytest.importorskip("orbax.checkpoint")

SPEC = frame.FrameSpec(
    num_layers=2,
    num_heads=1,
    head_dim=8,
    patches_per_frame=4,
    num_special=1,
    scale_frames=1,
    sliding_window=2,
    max_frames=8,
)


def test_refused_restores_leave_no_read_behind(tmp_path, monkeypatch):
    late = []  # results posted to an event loop Orbax had closed: each one a printed traceback
    post = asyncio.BaseEventLoop.call_soon_threadsafe

    def call_soon_threadsafe(loop, *args, **kwargs):
        if loop.is_closed():
            late.append(args[0])
        return post(loop, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", call_soon_threadsafe)
    state = frame.init(SPEC)
    for i in range(4):
        path = jaxkv.save(tmp_path / f"ck{i}", state)
        files = [
            f for f in (path / C.ARRAYS).rglob("*") if f.is_file() and f.parent.name == "d" and f.stat().st_size > 64
        ]
        assert files, "expected Orbax data files under arrays/d"
        for f in files:  # truncated: the arrays' reads fail one by one
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
        with pytest.raises(C.CheckpointError, match="corrupted"):
            jaxkv.restore(path)
    time.sleep(0.5)  # reads abandoned by a closed loop would post by now
    assert not late, f"{len(late)} reads ended after their event loop closed"
    assert "new_event_loop" not in vars(asyncio.get_event_loop_policy())  # the policy is as it was

"""DLPack views of jaxkv state: same memory, both directions, and the donation rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxkv import frame  # noqa: E402
from torch_bridge import from_torch, to_torch  # noqa: E402


def test_views_share_memory_both_ways(rng):
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)
    t = to_torch(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer() and t.dtype == torch.bfloat16
    np.testing.assert_array_equal(t.float().cpu().numpy(), np.asarray(x, np.float32))
    src = torch.randn(3, 5)
    y = from_torch(src)
    assert y.unsafe_buffer_pointer() == src.data_ptr()
    src.mul_(2)  # a torch write is what the next JAX op reads
    np.testing.assert_allclose(np.asarray(y + 0), src.numpy())
    with pytest.raises(ValueError, match="contiguous"):
        from_torch(src.t())


def test_fp8_crosses_as_fp8(rng):
    q = jnp.asarray(rng.standard_normal(16), jnp.float32).astype(jnp.float8_e4m3fn)
    t = to_torch(q)
    assert t.dtype == torch.float8_e4m3fn and t.data_ptr() == q.unsafe_buffer_pointer()
    back = from_torch(t)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(q).view(np.uint8))


def test_frame_cache_layer_view_and_donation_rule(rng):
    spec = frame.FrameSpec(
        num_layers=2, num_heads=2, head_dim=8, patches_per_frame=4, num_special=2, max_frames=8, dtype="float32"
    )
    state = frame.init(spec)
    k = jnp.asarray(rng.standard_normal((2, 1, 6, 2, 8)), jnp.float32)
    state = frame.append(state, k, -k)
    view = to_torch(state.k[1])  # [B, T, H, D], the layer's buffer itself
    rows = np.asarray(frame.visible_mask(state))[0]
    np.testing.assert_array_equal(view[0].cpu().numpy()[rows][:4], np.asarray(k[1, 0, 2:]))
    before = view.clone()
    if jax.default_backend() == "cpu":
        # the CPU client skips the donation (copies) instead of refusing; the view is untouched
        new = frame.append(state, k, -k)
        assert new.k[1].unsafe_buffer_pointer() != view.data_ptr()
        assert torch.equal(view, before)
        return
    with pytest.raises(Exception, match="external reference"):
        frame.append(state, k, -k)
    assert torch.equal(view, before)  # refused: nothing was written
    del view
    frame.append(state, k, -k)

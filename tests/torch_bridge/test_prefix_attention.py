"""``torch_bridge.kernels.prefix_attention``: the cuda/ prefix kernel launched from PyTorch on
strided views of a jaxkv buffer, against float32 attention over exactly the visible keys,
and bit-equal to the same kernel reached from JAX; its plan / run form (``PrefixAttention``,
the drop-in manager's per-layer path) bit-equal to the function."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bridge import kernels  # noqa: E402

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _ref(q, k, v, n):  # float32, q [Tq, Hq, D], k/v [T, H, D]
    G = q.shape[1] // k.shape[1]
    kk = k[:n].float().repeat_interleave(G, dim=1)
    vv = v[:n].float().repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the cuda prefix kernel needs an sm_90 GPU")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("n", [1, 1000, 2048, 5000])
@pytest.mark.parametrize("heads", [(16, 16), (8, 2)])
def test_prefix_attention_on_buffer_views(splits, n, heads):
    Hq, H = heads
    g = torch.Generator(device="cuda").manual_seed(n + 7 * splits + Hq)
    buf = torch.randn((2, 5120, H, 64), generator=g, device="cuda").bfloat16()  # [layers, T, H, D]
    k, v = buf[0], buf[1]
    qfull = torch.randn((1005, Hq, 3, 64), generator=g, device="cuda").bfloat16()
    q = qfull[:, :, 1]  # rows strided, heads contiguous? no: heads 3*64 apart -> refused below
    with pytest.raises(ValueError, match="q: expected its last two dims"):
        kernels.prefix_attention(q, k, v, n)
    q = qfull[:, :, 1].contiguous()
    out = kernels.prefix_attention(q, k, v, n, splits=splits)
    ref = _ref(q, k, v, n)
    err = (out.float() - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item() + 1e-3  # bf16 P and output
    again = kernels.prefix_attention(q, k, v, n, splits=splits)
    assert torch.equal(again, out)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the cuda prefix kernel needs an sm_90 GPU")
@pytest.mark.parametrize("launch", [(128, 2), (128, 4), (192, 2), (192, 3)])
def test_every_built_launch_shape(launch):
    """Each (keys per stage, stages) the kernel builds, which a tuning table may pick."""
    g = torch.Generator(device="cuda").manual_seed(launch[0] + launch[1])
    k, v = (torch.randn((6000, 4, 64), generator=g, device="cuda").bfloat16() for _ in range(2))
    q = torch.randn((300, 8, 64), generator=g, device="cuda").bfloat16()
    for n, splits in ((5001, 1), (4097, 3), (190, 1)):
        out = kernels.prefix_attention(q, k, v, n, splits=splits, launch=launch)
        ref = _ref(q, k, v, n)
        assert (out.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-3, (n, splits)
    with pytest.raises(ValueError, match="launch: expected a shape"):
        kernels.prefix_attention(q, k, v, 10, launch=(64, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the cuda prefix kernel needs an sm_90 GPU")
def test_torch_and_jax_launch_the_same_kernel():
    import jax.numpy as jnp

    from jaxkv.kernels import prefix_attention_cuda
    from torch_bridge import to_torch

    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((1, 4096, 16, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, 4096, 16, 64)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((1, 262, 16, 64)), jnp.bfloat16)
    n = 3001
    want = prefix_attention_cuda(q, k, v, jnp.asarray([n], jnp.int32))
    got = kernels.prefix_attention(to_torch(q)[0], to_torch(k)[0], to_torch(v)[0], n)
    torch.cuda.synchronize()
    assert np.array_equal(got.cpu().view(torch.int16).numpy(), np.asarray(want[0]).view(np.int16))


def test_prefix_attention_refuses_bad_input():
    if not ON_SM90:
        with pytest.raises(ValueError, match="device: expected an sm_90 CUDA GPU"):
            kernels.PrefixAttention("cpu", 2, 2)
    q = torch.zeros((4, 2, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: expected a CUDA bfloat16 tensor"):
        kernels.prefix_attention(q, q, q, 4)  # on the CPU
    with pytest.raises(ValueError, match="q: expected a CUDA bfloat16 tensor"):
        kernels.prefix_attention(q.float(), q, q, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the cuda prefix kernel needs an sm_90 GPU")
@pytest.mark.parametrize("heads", [(16, 16), (8, 2)])
def test_plan_run_equals_the_function(heads):
    """One plan, several layers' buffers, the plan changed between steps (also to splits > 1):
    each run gives the function's bits over the same keys; bad runs are refused."""
    Hq, H = heads
    g = torch.Generator(device="cuda").manual_seed(Hq + H)
    bufs = torch.randn((3, 2, 6000, H, 64), generator=g, device="cuda").bfloat16()  # [layers, k/v, T, H, D]
    attn = kernels.PrefixAttention("cuda", Hq, H)
    with pytest.raises(RuntimeError, match="call plan"):
        attn.run(torch.zeros((4, Hq, 64), dtype=torch.bfloat16, device="cuda"), bufs[0, 0], bufs[0, 1])
    for q_len, n, splits in ((1005, 5001, 1), (262, 4100, 2), (262, 1, 1)):
        q = torch.randn((q_len, Hq, 64), generator=g, device="cuda").bfloat16()
        attn.plan(q_len, n, splits)
        for layer in range(3):
            k, v = bufs[layer, 0], bufs[layer, 1]
            got = attn.run(q, k, v)
            want = kernels.prefix_attention(q, k[:n], v[:n], n, splits=splits)
            assert torch.equal(got, want), (q_len, n, splits, layer)
        ref = _ref(q, k, v, n)
        assert (got.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-3
    with pytest.raises(ValueError, match="q: expected a contiguous bf16 tensor"):
        attn.run(q[:10], k, v)
    with pytest.raises(ValueError, match=r"k, v: expected contiguous bf16 \[rows >= 1"):
        attn.run(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="splits: expected an int >= 1"):
        attn.plan(262, 10, 0)

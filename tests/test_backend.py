"""jaxkv._backend: the registry's refusals off a GPU."""

import pytest
from conftest import HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal off a GPU")
@pytest.mark.parametrize("operation", ["hybrid.write", "hybrid.gather", "hybrid.index_query"])
def test_cuda_kernels_need_a_gpu(operation):
    """Off a GPU: "auto" is xla, "cuda" is a ValueError that says why, other names (the
    never-released "pallas" among them) are refused."""
    from jaxkv import _backend

    assert _backend.choose(operation, "auto") == "xla"
    with pytest.raises(ValueError, match=f"impl='cuda' for {operation}: expected a CUDA GPU"):
        _backend.choose(operation, "cuda")
    for name in ("pallas", "triton"):
        with pytest.raises(ValueError, match=r"impl: expected one of \('auto', 'xla', 'cuda'\) for .*, got '" + name):
            _backend.choose(operation, name)


def test_flashmla_source_refusals(monkeypatch, tmp_path):
    """impl="flashmla" needs FlashMLA's tree: unset, or a directory without its sm90 sparse decode,
    is refused as "expected ..., got ..." naming FLASHMLA_SRC (also on a Hopper GPU, where the
    registry's message is this one)."""
    from jaxkv.cuda import flashmla

    monkeypatch.delenv("FLASHMLA_SRC", raising=False)
    with pytest.raises(ImportError, match="expected FLASHMLA_SRC set to a FlashMLA checkout .*, got it unset"):
        flashmla.source_dir()
    assert flashmla.missing().startswith("expected FLASHMLA_SRC")
    monkeypatch.setenv("FLASHMLA_SRC", str(tmp_path))
    with pytest.raises(
        ImportError,
        match=f"expected FLASHMLA_SRC to hold a FlashMLA tree .*, got {tmp_path}, missing under csrc/: .*sm90",
    ):
        flashmla.source_dir()


def test_torch_attention_rules():
    """The registry's checks and ``auto`` rule for the drop-in, on any machine: the context
    says what the torch side found (CUDA device, FlashInfer, the cuda kernel, dtype, head_dim);
    no torch needed."""
    from jaxkv import _backend

    def choose(backend="auto", device="cuda:0", **ctx):
        return _backend.choose("torch.attention", backend, device=device, **ctx)

    def refusal(backend, **ctx):
        with pytest.raises(ValueError) as e:
            choose(backend, **ctx)
        return str(e.value)

    assert choose(device="cpu") == choose(device="cpu", fa3=True, flashinfer=True) == "sdpa"
    assert choose(flashinfer=False, cuda_kernel=False) == choose(fa3=True, cuda_kernel=False) == "sdpa"
    assert choose(force_fp32=True, flashinfer=True, cuda_kernel=True) == "sdpa"
    assert choose(fa3=True, flashinfer=True, cuda_kernel=True) == "flashinfer-paged-fa3"
    for fi in (False, True):  # the cuda kernel wherever it runs (bf16, head_dim 64)
        for tpf in (262, 1005):
            assert choose(flashinfer=fi, tokens_per_frame=tpf, cuda_kernel=True) == "cuda"
        assert choose(flashinfer=fi, tokens_per_frame=1005, cuda_kernel=True, dtype="float16") == (
            "flashinfer" if fi else "sdpa"
        )
        assert choose(flashinfer=fi, tokens_per_frame=262, cuda_kernel=True, head_dim=128) == (
            "flashinfer-paged-fa2" if fi else "sdpa"
        )
    assert choose(flashinfer=True, tokens_per_frame=1005) == "flashinfer"
    assert choose(flashinfer=True, tokens_per_frame=262) == "flashinfer-paged-fa2"
    assert choose(tokens_per_frame=262) == "sdpa"
    for b in ("sdpa", "cuda", "flashinfer", "flashinfer-paged-fa2", "flashinfer-paged-fa3"):
        ok = dict(flashinfer=True, cuda_kernel=True)
        assert choose(b, **ok) == b
        if b != "sdpa":
            assert "needs a CUDA device, and device is cpu" in refusal(b, device="cpu", **ok)
            assert "force_fp32" in refusal(b, force_fp32=True, **ok)
    assert choose("sdpa", device="cpu", force_fp32=True) == "sdpa"
    assert refusal("flashinfer-paged-fa2", cuda_kernel=True).endswith(
        "got 'flashinfer-paged-fa2': flashinfer is not importable"
    )
    assert "sm_90 GPU and nvcc" in refusal("cuda", flashinfer=True)
    assert "expects bfloat16 storage and head_dim 64, got float16 and head_dim 64" in refusal(
        "cuda", cuda_kernel=True, dtype="float16"
    )
    assert refusal("cuda", cuda_kernel=True, head_dim=128).startswith(
        "backend: expected one of ('auto', 'sdpa', 'cuda', 'flashinfer', 'flashinfer-paged-fa2', "
        "'flashinfer-paged-fa3') that can run here, got 'cuda': "
    )

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
    with pytest.raises(ImportError, match=f"expected FLASHMLA_SRC to hold a FlashMLA tree .*, got {tmp_path}, "
                                          "missing under csrc/: .*sm90"):
        flashmla.source_dir()

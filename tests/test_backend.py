"""jaxkv._backend: the registry's refusals off a GPU."""

import pytest

from conftest import HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal off a GPU")
@pytest.mark.parametrize("operation", ["hybrid.write", "hybrid.gather", "hybrid.index_query"])
def test_cuda_kernels_need_a_gpu(operation):
    """Off a GPU: "auto" is xla, "cuda" is a ValueError that says why, the old "pallas" name is
    read as "cuda" with a DeprecationWarning (and so refused the same way), other names refused."""
    from jaxkv import _backend

    assert _backend.resolve(operation, "auto") == "xla"
    with pytest.raises(ValueError, match=f"impl='cuda' for {operation}: expected a CUDA GPU"):
        _backend.resolve(operation, "cuda")
    with pytest.warns(DeprecationWarning, match=f"impl='pallas' for {operation} is now impl='cuda'"):
        with pytest.raises(ValueError, match="expected a CUDA GPU"):
            _backend.resolve(operation, "pallas")
    with pytest.raises(ValueError, match=r"impl: expected one of \('auto', 'xla', 'cuda'\)"):
        _backend.resolve(operation, "triton")

"""Where the Triton-lowered Pallas kernels run, and what ``impl="auto"`` picks for them.

On a GPU they run natively; elsewhere in interpret mode (CPU tests), which needs only the
lowering's Python module. JAX 0.11 deprecates the Pallas Triton lowering: in a jax without
it, ``"auto"`` falls back to the XLA paths (same bytes, slower) and an explicit
``impl="pallas"`` raises a ``ValueError`` that says so, instead of an ImportError from
inside a trace. (``kernels.prefix_attention`` uses the Mosaic GPU lowering and is
unaffected.)
"""

from __future__ import annotations

import functools
import importlib

import jax


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    """Whether this jax still has the Pallas Triton lowering the kernels are written for."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError:
        return False
    return True


def interpret() -> bool:
    """Interpret mode for the kernels: off a GPU."""
    return jax.default_backend() != "gpu"


def auto_impl() -> str:
    """``"pallas"`` on a GPU whose jax has the Triton lowering, else ``"xla"``."""
    return "pallas" if not interpret() and has_triton() else "xla"


def check_pallas(impl: str) -> str:
    """``impl``, after checking that ``"pallas"`` can run here."""
    if impl == "pallas" and not has_triton():
        raise ValueError(f"impl='pallas': jax {jax.__version__} has no Pallas Triton lowering "
                         "(jax.experimental.pallas.triton), which this kernel uses; pass impl='xla' "
                         "or impl='auto', which falls back to it")
    return impl

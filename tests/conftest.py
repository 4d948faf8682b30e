import os
import zlib

if os.environ.get("PYTEST_XDIST_WORKER"):  # several test processes share one GPU: no preallocation
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to jax")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    # Fresh random inputs per test, reproducible from the test's name.
    seed = zlib.crc32(request.node.nodeid.encode())  # not hash(): str hashes change per process
    return np.random.default_rng(seed)


LONG = os.environ.get("JAXKV_LONG") == "1"


def machine_settings(examples: int, steps: int):
    """Hypothesis settings of a state machine: ``examples`` sequences of up to ``steps``
    operations by default (within CI's budget); with ``JAXKV_LONG=1``, 10,000 sequences, or
    ``JAXKV_EXAMPLES`` if set."""
    from hypothesis import settings

    n = int(os.environ.get("JAXKV_EXAMPLES", 10_000)) if LONG else examples
    return settings(max_examples=n, stateful_step_count=steps, deadline=None)

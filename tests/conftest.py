import atexit
import os
import shutil
import tempfile
import zlib

# One XLA compilation cache for the whole run: xdist workers and the fresh processes that
# tests start (checkpoints, meshes, notebooks, the CLI) inherit it, so a program compiled by
# one is loaded by the others. A cache you set yourself is used as is and kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxkv-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

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
if not HAS_GPU:  # on a CPU the suite is compile-bound: XLA's quick compile, here and in child processes
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


LONG = os.environ.get("JAXKV_LONG") == "1"
SANITIZE = os.environ.get("JAXKV_SANITIZE") == "1"  # under compute-sanitizer: tools/sanitize.py


# The default run's longest tests (about a minute or more each on a 2-core CPU), started
# first so that xdist's workers end together instead of one finishing a long test alone.
LONGEST_FIRST = (
    "tests/cuda/test_wheel.py",
    "tests/test_notebooks.py",
    "tests/hybrid/test_hybrid.py::test_decode_equals_prefill",
    "tests/models/test_lingbot_cli.py",
    "tests/hybrid/test_tier.py",
    "tests/hybrid/test_attention.py",
)


# Tests that run on whatever device torch sees: on a GPU machine they are GPU tests too, so
# the ``gpu`` marker (``-m gpu``) selects them there.
ON_TORCH_DEVICE = ("tests/torch_bridge/",)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the markers added here
def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without a GPU; on a GPU machine the torch tests (``ON_TORCH_DEVICE``)
    are ``gpu`` tests too. ``slow`` tests (minutes of compiling on a CPU, where a
    smaller test of the default run checks the same rule) run where a GPU is, or with
    ``JAXKV_LONG=1``: the default run stays within CI's budget. ``exhaustive`` tests (every
    case of an identity, seconds natively) skip under compute-sanitizer, where they would take
    hours: the kernels they exercise run there through the other tests. The longest tests
    run first (``LONGEST_FIRST``)."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU visible to jax")
    long = pytest.mark.skip(reason="long on a CPU: runs with JAXKV_LONG=1 (and where a GPU is)")
    sanitized = pytest.mark.skip(reason="exhaustive: not under compute-sanitizer (JAXKV_SANITIZE=1)")
    for item in items:
        if HAS_GPU and item.nodeid.startswith(ON_TORCH_DEVICE):
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(no_gpu)
        elif "slow" in item.keywords and not (HAS_GPU or LONG):
            item.add_marker(long)
        if "exhaustive" in item.keywords and SANITIZE:
            item.add_marker(sanitized)
    rank = {p: i for i, p in enumerate(LONGEST_FIRST)}
    first = lambda item: next((rank[p] for p in LONGEST_FIRST if item.nodeid.startswith(p)), len(rank))  # noqa: E731
    items.sort(key=first)  # stable: the rest keep their order


@pytest.fixture
def rng(request):
    # Fresh random inputs per test, reproducible from the test's name.
    seed = zlib.crc32(request.node.nodeid.encode())  # not hash(): str hashes change per process
    return np.random.default_rng(seed)


def machine_settings(examples: int, steps: int):
    """Hypothesis settings of a state machine: ``examples`` sequences of up to ``steps``
    operations by default (within CI's budget); with ``JAXKV_LONG=1``, 10,000 sequences, or
    ``JAXKV_EXAMPLES`` if set."""
    from hypothesis import settings

    n = int(os.environ.get("JAXKV_EXAMPLES", 10_000)) if LONG else examples
    return settings(max_examples=n, stateful_step_count=steps, deadline=None)

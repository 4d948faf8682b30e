"""The serving loop (``models.dsv4_serving``): a shared-prefix workload finishes with prefix
hits (from the device and from host memory), fewer prompt tokens computed, the same tokens
generated as without sharing, and, with
a pool too small for all requests at once, preemption by offload and reload."""

import numpy as np
import pytest

pytest.importorskip("flax")

from jaxkv.models.dsv4_serving import Server, shared_prefix_workload, small_model  # noqa: E402


def _serve(share, pool_tokens=None, requests=6, burst=False, **kw):
    server = Server(small_model(max_requests=10, max_context=128, pool_tokens=pool_tokens), 16, share=share, **kw)
    reqs = [
        server.submit(p, 4, arrival=0 if i < 2 or burst else 6 + i)
        for i, p in enumerate(shared_prefix_workload(requests, 2, 64, 16, 256, seed=1))
    ]
    server.run(max_steps=400)
    return server, reqs


@pytest.mark.slow  # notebooks/prefix_serving.ipynb checks the same tokens and hit rate in the default run
def test_shared_prefixes_hit_and_generate_the_same_tokens():
    off, reqs_off = _serve(False)
    on, reqs_on = _serve(True)
    assert all(len(r.out) == 4 for r in reqs_on + reqs_off)
    assert [r.out for r in reqs_on] == [r.out for r in reqs_off]  # hits are exact
    assert on.hit_rate > 0.5 and on.hit_tokens == sum(r.hit for r in reqs_on)
    assert on.prefilled == sum(len(r.prompt) for r in reqs_on) - on.hit_tokens < 0.5 * off.prefilled
    held = {s for s in on.snapshot_of}  # only snapshots hold blocks once all requests finished
    for a in on.state.alloc:
        rows = np.asarray(a.owned)
        assert all(rows[s] == 0 for s in range(len(rows)) if s not in held)


@pytest.mark.slow
def test_snapshots_in_host_memory_hit_too():
    """One snapshot kept on the device, the evicted ones in pinned host memory: hits come
    from both, and the tokens are those of the run without sharing."""
    on, reqs_on = _serve(True, snapshots=1, host_snapshots=8)
    _, reqs_off = _serve(False)
    assert on.host_hits > 0 and on.hit_tokens > 0
    assert [r.out for r in reqs_on] == [r.out for r in reqs_off]


@pytest.mark.slow
def test_a_small_pool_preempts_and_still_finishes():
    server, reqs = _serve(False, pool_tokens=96, burst=True)
    assert server.preemptions > 0
    assert all(len(r.out) == 4 for r in reqs)
    _, reqs_ref = _serve(False, burst=True)
    assert [r.out for r in reqs] == [r.out for r in reqs_ref]

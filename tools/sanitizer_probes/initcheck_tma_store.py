"""A Mosaic GPU kernel writes every element of its output with TMA stores (shared -> global);
an XLA fusion then reads them all. A tool that sees those stores reports 0 uninitialized reads.

    compute-sanitizer --tool initcheck python tools/sanitizer_probes/initcheck_tma_store.py

tools/sanitize.py --probes runs it; docs/reliability.md has what it gave. Exits 1 when the
values read are not the ones written (the stores did land, whatever initcheck says)."""

import sys

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

N, H = 4, 128  # a splat store to shared memory takes a multiple of 128 elements


def body(out_ref):  # out_ref: f32[N, H] in GMEM; program n writes row n
    def scoped(row):
        n = lax.axis_index("row")
        row[...] = jnp.full((H,), 1.0, jnp.float32) * n.astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(row, out_ref.at[n])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((H,), jnp.float32))


def main() -> int:
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((N, H), jnp.float32), grid=(N,), grid_names=("row",))
    got = np.asarray(jax.jit(lambda: jnp.exp(kernel()).sum(0))())
    want = np.full(H, sum(np.exp(np.arange(N, dtype=np.float64))), np.float32)
    ok = np.allclose(got, want, rtol=1e-5)
    print(f"initcheck_tma_store: {N * H} elements written, the sums {'match' if ok else 'DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

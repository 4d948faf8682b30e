"""What Mosaic GPU cannot express on Hopper, kept as minimal kernels that must keep failing.

The kernels whose work is byte encoding and row gather / scatter (FP4 packing, the
flush-write, the dequant-gather, the fused decode compressor) name these limits as the
reason they are not Mosaic GPU kernels. If one of these tests starts to fail, the limit is
gone in this jax: port the kernels that cite it.
"""

import jax
import jax.numpy as jnp
import pytest

S = jax.ShapeDtypeStruct


def _pallas():
    try:
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu
    except ImportError as e:  # a jaxlib without the Mosaic GPU dialect
        pytest.skip(f"this jaxlib has no Mosaic GPU: {e}")
    return pl, plgpu


def strided_pairs(x):
    """The even elements of each row into registers: what packing two E2M1 codes per byte
    needs, short of per-thread shuffles (which Pallas does not expose)."""
    pl, plgpu = _pallas()

    def body(x_ref, o_ref, scratch):
        xs, bar = scratch
        plgpu.copy_gmem_to_smem(x_ref, xs, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        o_ref[...] = plgpu.load(xs.at[:, pl.ds(0, 64, stride=2)], (), layout=plgpu.Layout.WG_STRIDED((64, 64), 1))

    scratch = (plgpu.SMEM((64, 128), jnp.float32), plgpu.Barrier(num_arrivals=1, num_barriers=1))
    return plgpu.kernel(body, out_type=S((64, 64), jnp.float32), scratch_types=(scratch,))(x)


def row_scatter(x, rows):
    """32 rows of 256 bytes scattered to the rows ``rows`` names (TMA's scatter4)."""
    pl, plgpu = _pallas()

    def body(x_ref, idx_ref, o_ref, scratch):
        xs, ids, bar = scratch
        plgpu.copy_gmem_to_smem(x_ref, xs, bar.at[0])
        plgpu.copy_gmem_to_smem(idx_ref, ids, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        plgpu.copy_smem_to_gmem(xs, o_ref.at[plgpu.load(ids, (), layout=plgpu.Layout.TMA_INDICES)])
        plgpu.wait_smem_to_gmem(0)

    scratch = (
        plgpu.SMEM((32, 256), jnp.uint8),
        plgpu.SMEM((32,), jnp.uint32),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
    )
    return plgpu.kernel(body, out_type=S((1024, 256), jnp.uint8), scratch_types=(scratch,))(x, rows)


def test_no_strided_register_loads():
    with pytest.raises(NotImplementedError, match="Strided slices"):
        jax.jit(strided_pairs).trace(S((64, 128), jnp.float32)).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
def test_no_row_scatter_on_hopper():
    """The scatter lowers (Mosaic GPU targets Blackwell too) but does not compile for sm_90."""
    if not str(jax.devices()[0].compute_capability).startswith("9."):
        pytest.skip("the limit is Hopper's")
    x = jnp.arange(32 * 256, dtype=jnp.uint32).astype(jnp.uint8).reshape(32, 256)
    rows = jnp.arange(32, dtype=jnp.uint32) * 7
    with pytest.raises(Exception) as err:
        jax.block_until_ready(jax.jit(row_scatter)(x, rows))
    print(f"row scatter on {jax.devices()[0].device_kind}: {type(err.value).__name__}: {str(err.value)[:300]}")

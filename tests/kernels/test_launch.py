"""jaxkv.kernels.launch: the SM count and its fallback, every key-split rule, the launch tables."""

import types

import pytest

from jaxkv.kernels import launch as L


def test_sm_count_reads_the_device_and_falls_back_once():
    assert L.sm_count(types.SimpleNamespace(core_count=78)) == 78
    for dev in (types.SimpleNamespace(), types.SimpleNamespace(core_count=None), types.SimpleNamespace(core_count=0)):
        assert L.sm_count(dev) == L.SM_FALLBACK
    import jax

    assert L.sm_count() == L.sm_count(jax.devices()[0]) >= 1


def test_wave_splits_fills_waves_smallest_on_a_tie():
    # 3 query tiles x 16 heads = 48 programs on 132 SMs: x8 fills 384 / 396 slots, the best
    assert L.wave_splits(262, 16, [1, 2, 4, 8, 16], 132) == 8
    assert L.wave_splits(1005, 16, [1, 2, 4, 8, 16], 132) == 1  # 128 programs: already 0.97 of a wave
    assert L.wave_splits(128, 1, [1, 2, 4], 4) == 4  # 4 programs on 4 SMs: full
    assert L.wave_splits(128, 2, [1, 2, 4], 4) == 2  # x2 and x4 both fill every wave: the smaller
    assert L.wave_splits(262, 16, [], 132) == 1
    assert L.wave_splits(262, 16, [1, 2], 0) == 1  # 0 SMs counts as 1: every count fills it, the smallest wins


def test_prefix_splits_whole_256_row_chunks():
    assert L.prefix_splits(1005, 16, 81920, 132) == 1  # 128 programs already fill one wave of 132 SMs
    assert L.prefix_splits(262, 16, 26624, 132) == 8  # 48 programs: 8 chunks fill 2.9 waves
    assert L.prefix_splits(262, 16, 26624 + 256, 132) == 1  # no equal split into 256-row blocks
    for rows in (256, 4096, 26624, 81920):
        n = L.prefix_splits(262, 16, rows, 132)
        assert rows % (n * 256) == 0
    assert L.prefix_splits(262, 16, 26624) == L.prefix_splits(262, 16, 26624, L.sm_count())


def test_prefix_cuda_splits_keeps_chunks_long():
    got = [L.prefix_cuda_splits(t, 16, n, 132) for t, n in ((1005, 72648), (262, 19152), (262, 3000), (262, 100))]
    assert got == [1, 2, 1, 1]
    for keys in (0, 100, 4095, 8192, 16384, 40000, 100000):
        n = L.prefix_cuda_splits(262, 16, keys, 132)
        assert n == 1 or keys >= n * L.PREFIX_CUDA_MIN_CHUNK


def test_pool_splits_one_wave_no_idle_split():
    """Every split gets a block, the programs fit one wave where the batch allows, and no
    fewer blocks per split would: V4-Flash (64 heads, 10 blocks) and V4-Pro (128, 18)."""
    sms = 132
    for heads in (64, 128, 192):
        for blocks in (1, 2, 3, 9, 10, 18, 33, 128):
            for rows in (1, 2, 3, 4, 7, 8, 16, 32, 40, 64, 65, 128, 1024):
                S = L.pool_splits(rows, heads, blocks, sms)
                per = -(-blocks // S)
                groups = rows * (heads // L.POOL_BLOCK)
                assert 1 <= S <= blocks and (S - 1) * per < blocks, (rows, heads, blocks, S)
                assert S == 1 or groups * S <= sms, (rows, heads, blocks, S)
                fits = [n for n in range(1, blocks + 1) if groups * n <= sms] or [1]  # split counts in one wave
                assert per == min(-(-blocks // n) for n in fits), (rows, heads, blocks, S)  # no fewer blocks per split
    assert [L.pool_splits(b, 64, 10, sms) for b in (1, 8, 16, 32, 64, 128)] == [10, 10, 5, 4, 2, 1]
    assert [L.pool_splits(b, 128, 18, sms) for b in (1, 2, 4, 8, 64)] == [18, 18, 9, 6, 1]


def test_pool_block_is_the_kernels():
    from jaxkv.kernels.pool_attention import BLOCK

    assert L.POOL_BLOCK == BLOCK


@pytest.mark.parametrize(
    "heads, splits, parts", [(64, 1, 1), (64, 2, 1), (64, 4, 4), (128, 2, 2), (192, 2, 1), (128, 3, 3)]
)
def test_pool_cuda_parts(heads, splits, parts):
    """Two splits over an odd number of 64-head groups merge in the kernel (a 2-CTA cluster)."""
    assert L.pool_cuda_parts(heads, splits) == parts


def test_flashmla_sm_parts():
    assert L.flashmla_sm_parts(64, 132) == 132 and L.flashmla_sm_parts(128, 132) == 66
    assert L.flashmla_sm_parts(128, 1) == 1


def test_launch_tables():
    assert L.launch("frame_append", L.DEFAULT) == L.TABLES[L.DEFAULT]["frame_append"]
    assert L.launch("prefix_attention", "some other GPU") == L.TABLES[L.DEFAULT]["prefix_attention"]
    assert L.launch("index_scores") == L.TABLES.get(L.device_kind(), L.TABLES[L.DEFAULT])["index_scores"]
    for table in L.TABLES.values():
        assert set(table) <= set(L.TABLES[L.DEFAULT])

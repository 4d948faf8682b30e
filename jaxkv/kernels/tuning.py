"""Launch parameters of the Pallas kernels, as data.

``*_ROWS``: items per program (a power of two: Triton blocks); ``*_WARPS``: warps per
program; by storage family where the families differ. Chosen by sweeps on ``SWEPT_ON``;
the sweeps' figures are in ``benchmarks/RESULTS.md`` ("Launch-parameter sweeps").
Re-sweep on another GPU.
"""

SWEPT_ON = "NVIDIA H100 80GB HBM3"

FRAME_APPEND_ROWS = 16
FRAME_APPEND_WARPS = 4

MXFP4_ROWS = 32
MXFP4_WARPS = 8

FLUSH_WRITE_ROWS = {"official": 16, "per_entry": 2}
FLUSH_WRITE_WARPS = {"official": 4, "per_entry": 1}

DEQUANT_GATHER_ROWS = 16  # not swept
DEQUANT_GATHER_WARPS = 4

COMPRESS_DECODE_WARPS = {"official": 4, "per_entry": 2}  # one request per program

PREFIX_ATTENTION_BLOCK_KV = 256  # keys per TMA block (Mosaic GPU)
PREFIX_ATTENTION_STAGES = 2  # blocks in flight

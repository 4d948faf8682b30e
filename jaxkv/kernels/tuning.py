"""Launch parameters of the Pallas kernels (Triton lowering), in one place.

``*_ROWS``: items per program (a power of two: Triton blocks); ``*_WARPS``: warps per
program. Each figure is GPU kernel time on an NVIDIA H100 80GB HBM3 from a sweep of the
alternatives named (``benchmarks/RESULTS.md``); re-sweep on another GPU.
"""

# a frame's rows into every layer (24 layers x 1005 tokens): 16 x 4 / 16 x 8 at copy
# bandwidth (0.073 ms); 32 x 4 0.103 ms, 64 x 4 0.25 ms
FRAME_APPEND_ROWS = 16
FRAME_APPEND_WARPS = 4

# MXFP4 packing, 2M keys: 32 x 8 (or 16 x 4) 0.557 ms, 99% of copy; 32 x 4 1.044 ms, 64 x 2 1.24 ms
MXFP4_ROWS = 32
MXFP4_WARPS = 8

# flush-write by storage family, kernel time at 4,096 / 65,536 entries. official: 16 x 4
# 4.38 / 54.1 us, 4 x 4 4.72 / 58.1 us. seed, with the shared-divisor division: 2 x 1
# 4.99 / 59.4 us, 4 x 1 4.92 / 64.4, 4 x 2 5.33 / 59.3, 8 x 4 5.31 / 59.9, 16 x 4 5.06 / 68.0,
# 1 x 1 5.80 / 63.6. (An earlier sweep that found every setting equal had patched the
# function, not this module's constants.)
FLUSH_WRITE_ROWS = {"official": 16, "seed": 2}
FLUSH_WRITE_WARPS = {"official": 4, "seed": 1}

# dequant-gather: not swept
DEQUANT_GATHER_ROWS = 16
DEQUANT_GATHER_WARPS = 4

# fused decode compressor, one request per program, by storage family: CSA at 4,096 requests
# official 2 / 4 / 8 warps 0.158 / 0.120 / 0.728 ms; seed 0.157 / 0.245 / 0.302 ms
COMPRESS_DECODE_WARPS = {"official": 4, "seed": 2}

# prefix attention (Mosaic GPU, FA3-style), 1024 queries x 71,680 keys, H=16, D=64, f16 on an
# H100: keys per TMA block x blocks in flight 256 x 2 0.612 ms, 128 x 2/4 0.635 ms, 64 x 2/4
# 0.784 ms; 256 x 4 exceeds shared memory
PREFIX_ATTENTION_BLOCK_KV = 256
PREFIX_ATTENTION_STAGES = 2

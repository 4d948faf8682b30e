"""Tuning constants of the frame cache's attention, measured on an H200 (benchmarks/RESULTS.md)."""

# Split-KV for cuDNN: split the keys into the smallest power-of-two number of chunks that
# gives at least CUDNN_TARGET_CTAS_PER_SM * SMs (query tiles x heads x chunks) work
# units, at most CUDNN_MAX_SPLITS. On an H200, 8 chunks were fastest both at 224x224 (262
# queries) and at 518x378 (1005 queries) — benchmarks/attention_variants.py.
CUDNN_Q_TILE = 128
CUDNN_TARGET_CTAS_PER_SM = 8
CUDNN_MAX_SPLITS = 8

# Split-KV for the Pallas prefix kernel (``attention.prefix_splits``): its programs are
# 128-query tiles x heads x chunks, one per SM at a time; the chunk count that fills the
# waves best wins. H100, one layer: 1005 queries (128 programs) 1 chunk 0.604 ms, 2 / 4 / 8
# / 16 chunks 0.670 / 0.687 / 0.640 / 0.663; 262 queries (48 programs) 8 chunks 0.099 ms,
# 1 / 2 / 4 / 16 chunks 0.162 / 0.119 / 0.120 / 0.106 (benchmarks/RESULTS.md).

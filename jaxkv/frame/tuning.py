"""Tuning constants of the frame cache's attention, measured on an H200 (benchmarks/RESULTS.md)."""

# Split-KV for cuDNN: split the keys into the smallest power-of-two number of chunks that
# gives at least CUDNN_TARGET_CTAS_PER_SM * SMs (query tiles x heads x chunks) work
# units, at most CUDNN_MAX_SPLITS. On an H200, 8 chunks were fastest both at 224x224 (262
# queries) and at 518x378 (1005 queries) — benchmarks/attention_variants.py.
CUDNN_Q_TILE = 128
CUDNN_TARGET_CTAS_PER_SM = 8
CUDNN_MAX_SPLITS = 8

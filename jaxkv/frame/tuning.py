"""Tuning constants of the frame cache's attention, as data; chosen by sweeps whose figures
are in ``benchmarks/RESULTS.md`` ("Launch-parameter sweeps")."""

# Split-KV for cuDNN (``attention.cudnn_splits``): the smallest power-of-two number of key
# chunks giving at least CUDNN_TARGET_CTAS_PER_SM * SMs (query tiles x heads x chunks) work
# units, at most CUDNN_MAX_SPLITS.
CUDNN_Q_TILE = 128
CUDNN_TARGET_CTAS_PER_SM = 8
CUDNN_MAX_SPLITS = 8

# Split-KV for the Pallas prefix kernel (``attention.prefix_splits``) has no constants: its
# programs are 128-query tiles x heads x chunks, and the chunk count that fills the SMs'
# waves best wins.

"""Every quantized layout jaxkv stores, each with quantize / dequantize in plain jnp.

| format | functions |
| --- | --- |
| FP8 E4M3, float32 scale per entry | ``quantize_fp8_per_entry`` / ``dequantize_fp8_per_entry`` |
| FP8 E4M3, UE8M0 scale per 64-element tile | ``quantize_fp8_ue8m0`` / ``dequantize_fp8_ue8m0`` |
| FP8 E4M3, bfloat16 scale per row (the frame cache's FP8 K/V) | ``quantize_fp8_rows`` / ``dequantize_fp8_rows`` |
| ``ds_mla`` 584-byte-per-token block | ``pack_ds_mla`` / ``unpack_ds_mla`` |
| NVFP4 (E2M1, E4M3 per 16, fp32 global) | ``quantize_nvfp4`` / ``dequantize_nvfp4`` |
| MXFP4 (E2M1, UE8M0 per 32) | ``quantize_mxfp4`` / ``dequantize_mxfp4`` |
"""

from jaxkv.formats.ds_mla import BYTES_PER_TOKEN as DS_MLA_BYTES_PER_TOKEN
from jaxkv.formats.ds_mla import pack_ds_mla, split_ds_mla, unpack_ds_mla
from jaxkv.formats.fp4 import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    nvfp4_global_scale,
    pack_nibbles,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_nibbles,
)
from jaxkv.formats.fp8 import (
    dequantize_fp8_per_entry,
    dequantize_fp8_rows,
    dequantize_fp8_ue8m0,
    quantize_fp8_per_entry,
    quantize_fp8_rows,
    quantize_fp8_ue8m0,
)

__all__ = [
    "DS_MLA_BYTES_PER_TOKEN",
    "dequantize_fp8_per_entry",
    "dequantize_fp8_rows",
    "dequantize_fp8_ue8m0",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "nvfp4_global_scale",
    "pack_ds_mla",
    "pack_nibbles",
    "quantize_fp8_per_entry",
    "quantize_fp8_rows",
    "quantize_fp8_ue8m0",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "split_ds_mla",
    "unpack_ds_mla",
    "unpack_nibbles",
]

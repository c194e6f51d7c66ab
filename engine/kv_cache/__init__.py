"""The paged KV cache's dtype and, for fp8, its scales (vLLM's `--kv-cache-dtype`).

- `spec.py`: `--kv-cache-dtype auto|bfloat16|float16|float32|fp8` -> a torch dtype;
- `fp8_scales.py`: per-head or per-tensor fp8 scales, calibrated once at startup, and their digest
  (part of the layout fingerprint, so KV quantised with other scales never shares keys).
"""

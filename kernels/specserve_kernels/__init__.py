"""Triton-language kernels, each beside its torch reference with the same signature.

    gemv.py                     gemv_ref; gemv -> gemv_triton.py (linear layers at 1-16 rows)
    kv_cache.py                 store_kvcache_ref (the fused kernel stores K/V: rotary_store_kv)
    paged_attention.py          paged_attention_ref; paged_attention -> decode or extend kernel
    paged_attention_decode.py   one query per request: GQA groups, split-KV + combine
    paged_attention_extend.py   ragged causal queries: prefill, chunks, prefix hits, verification
    rms_norm.py                 rms_norm_ref; rms_norm -> rms_norm_triton.py (residual add fused)
    rotary.py                   rotary_store_kv(_ref) -> rotary_triton.py: RoPE of q and k, then k and v
                                stored in the cache (one launch)
    silu_mul.py                 silu_mul_ref; silu_mul -> silu_mul_triton.py (gate/up halves, one launch)
    launch.py                   argument checks and tile choices shared by the wrappers

The reference modules import Triton only when a kernel is first called.
"""

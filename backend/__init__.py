"""specserve engine: continuous batching over a paged KV cache, with speculative decoding.

Plain Python + torch; it knows nothing of Triton (serving/ adapts it to tritonserver).
"""

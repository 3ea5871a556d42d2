"""specserve engine: continuous batching over a paged KV cache, with speculative decoding.

Plain Python + torch. Only model_repository/llm_engine imports triton_python_backend_utils.
"""

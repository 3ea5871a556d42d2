"""The OpenAI-compatible HTTP server in front of tritonserver.

    server.py             the FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (streamed
                          as server-sent events, or whole), /health, the experiments' endpoints
    triton_generation.py  one generation over a gRPC stream to the `llm` model, and its stop
    reply.py              OpenAI's response bodies and stream chunks
    protocol.py           OpenAI request bodies -> the `llm` model's inputs, and its outputs back
    guard.py              what a request must be before a handler sees it (size, concurrency, API key)
    experiment_gate.py    an A/B experiment's arms, records and rollout; experiment_page.py its live page
    tool_calls.py         tools rendered into the prompt and calls read back, with tool_parsers.py
                          (hermes, llama3_json, mistral), tool_stream.py (streamed calls) and
                          chat_template.py (a model template that takes tools)
"""

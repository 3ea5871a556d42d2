"""The OpenAI-compatible HTTP server in front of tritonserver.

    server.py      the FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (streamed as
                   server-sent events, or whole), /health, and the experiments' endpoints
    protocol.py    OpenAI request bodies -> the `llm` model's inputs, and its outputs back
    guard.py       what a request must be before a handler sees it (size, concurrency, API key)
    tool_calls.py  tools rendered into the prompt, and tool calls read back, streamed or not
"""

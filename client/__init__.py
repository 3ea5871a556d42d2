"""Streaming client library and CLI for specserve (tritonclient gRPC stream and HTTP SSE)."""

"""The engine in a process of its own: the engine core behind ZeroMQ, its client in the serving
process, and the typed messages between them."""

"""The model and what runs it: the Llama module, attention backends, weight loading (with each
rank's share and each pipeline stage's layers), the runner with its CUDA graphs, and the step inputs."""

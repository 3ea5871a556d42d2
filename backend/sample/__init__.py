"""Sampling on the device: the per-step sampling metadata, the sampler (penalties, temperature,
top-k/p, min-p, seeds, logprobs) and the verification of draft tokens by rejection sampling."""

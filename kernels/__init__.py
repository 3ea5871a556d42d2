"""Triton-language kernels, each beside its torch reference with the same signature."""

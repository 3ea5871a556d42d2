"""Seeded sampling keyed on (seed, position): a seeded request's token at a position depends on its
seed, that position and the distribution there, and on nothing else.

A seeded row draws by the exponential race (the Gumbel-max trick in another form): with
E_x ~ Exp(1) independent per token x, argmax_x p(x) / E_x is distributed exactly as p. The E_x are
not drawn from a stream but hashed from (the seed, the index of the output token the row samples,
x), so the draw at a position is the same whatever was drawn before it, whatever k speculation
chose, whichever request sits beside it and on which instance. Speculation verifies a seeded
request's drafts against these draws: draft d_i is accepted iff it equals the target's keyed
sample at its position, and the first mismatch takes that sample instead (rejection_sampler.py).
Every kept token is then the target's keyed sample, so the output is exactly the target's
distribution and does not depend on what was drafted. A draft drawn with the same noise
(draft model, EAGLE head) agrees with the target wherever p and q are close; a one-hot draft
(n-gram) is accepted with probability p(d), as under rejection sampling.

The hash is a 32-bit integer hash (Wellons' lowbias32) computed with int64 tensor ops that never
overflow, so it gives the same bits on every device; p / E is then float arithmetic, and like
every sampled token it can move when the logits do (another dtype, model or summation order).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2^32 for x < 2^32, in pieces whose products stay below 2^63 (int64 tensors)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 0x10000) & MASK32


def hash32(x):
    """lowbias32 on ints or int64 tensors in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


GOLDEN = 0x9E3779B9  # keeps 0 from hashing to 0


def seed_key(seed: int) -> int:
    """A request's 64-bit seed folded into a 32-bit key."""
    return hash32((seed & MASK32) ^ hash32((seed >> 32) ^ GOLDEN))


def row_keys(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[S] int64 keys of rows: a request's key and the output index each row samples."""
    return hash32(seed_keys ^ hash32((positions & MASK32) ^ GOLDEN))


BLOCK = 256  # tokens per block of the two-level race


def exponential_noise(keys: torch.Tensor, size: int) -> torch.Tensor:
    """[S, size] float32 Exp(1) noise, one independent draw per (row key, index)."""
    index = torch.arange(size, device=keys.device, dtype=torch.int64)
    bits = hash32(hash32(keys[:, None] ^ index[None, :]) ^ keys[:, None])
    # 23 bits, so that the largest value, 1 - 2^-24, is a float32 below 1: no noise is 0
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(uniform)


def keyed_sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[S] int64: each row's token by the exponential race over probs [S, vocab] (rows need not
    sum to 1; a zero-probability token is never drawn), run in two levels so that a row hashes
    about 2 sqrt(vocab) numbers, not vocab: a block of BLOCK tokens by the race over the blocks'
    masses, then a token of that block by the race within it. The race's minimum over a block is
    Exp(its mass) and its winner is distributed as p within the block, independently, so the two
    levels draw exactly as one race over every token would."""
    num_rows, vocab = probs.shape
    num_blocks = -(-vocab // BLOCK)
    if num_blocks * BLOCK != vocab:
        probs = torch.nn.functional.pad(probs, (0, num_blocks * BLOCK - vocab))
    blocks = probs.view(num_rows, num_blocks, BLOCK)
    block = (blocks.sum(-1) / exponential_noise(keys, num_blocks)).argmax(-1)  # [S]
    within = blocks[torch.arange(num_rows, device=probs.device), block]  # [S, BLOCK]
    block_keys = hash32(keys ^ hash32(block + num_blocks))  # another key per (row, block)
    return block * BLOCK + (within / exponential_noise(block_keys, BLOCK)).argmax(-1)

"""Paged KV-cache block accounting: free queue, ref counts, prefix caching.

The block manager counts; the scheduler decides. A block is `block_size` token slots in every
layer's K and V pool (and in the draft model's pool, which shares the block ids).

Prefix caching: a full block is identified by a chained hash of (parent block's hash, its tokens).
A freed block keeps its hash and stays findable until it is handed out again, so a later request
with the same prefix reuses it (the tokens are compared on a hit, so a hash collision is harmless).
Free blocks are handed out least recently freed first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from backend.core.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold num_tokens tokens."""
    return (num_tokens + block_size - 1) // block_size


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_hit_tokens = 0  # counters for metrics
        self.prefix_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent_hash, token_ids))

    def match_prefix(self, request: Request) -> int:
        """Attach cached blocks holding a prefix of the request's tokens; returns the number of
        tokens they hold. At least one token is always left to compute (it yields the logits)."""
        if not self.enable_prefix_caching or request.block_table:
            return 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        parent: int | None = None
        hits: list[int] = []
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            chained = self.chain_hash(parent, chunk)
            block_id = self.hash_to_block_id.get(chained)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = chained
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        request.block_table = hits
        request.num_cached_blocks = len(hits)
        request.cached_chain_hash = parent
        self.prefix_query_tokens += len(tokens)
        self.prefix_hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full of computed tokens (never draft tokens:
        those are not counted in num_computed_tokens until accepted)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        tokens = request.all_token_ids
        parent = request.cached_chain_hash  # the chain up to the blocks registered before
        for i in range(request.num_cached_blocks, num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = self.chain_hash(parent, chunk)
            block = self.blocks[request.block_table[i]]
            # an identical block may already be cached (computed by another request): keep it
            if block.block_hash is None and parent not in self.hash_to_block_id:
                block.block_hash = parent
                block.token_ids = chunk
                self.hash_to_block_id[parent] = block.block_id
        request.num_cached_blocks = num_full
        request.cached_chain_hash = parent

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens. All or nothing."""
        need = self.blocks_needed(num_tokens) - len(request.block_table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict from the prefix cache
                if self.hash_to_block_id.get(block.block_hash) == block_id:
                    del self.hash_to_block_id[block.block_hash]
                block.block_hash = None
                block.token_ids = ()
            block.ref_count = 1
            request.block_table.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Release all the request's blocks (finish, abort, preemption). The last blocks are
        queued first so that a prefix's head stays cached longest."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        request.block_table = []
        request.num_cached_blocks = 0
        request.cached_chain_hash = None

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks past those needed for `num_tokens` (after rejected draft tokens)."""
        keep = self.blocks_needed(num_tokens)
        while len(request.block_table) > keep:
            block_id = request.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None

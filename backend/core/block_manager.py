"""Paged KV-cache block accounting: free queue, ref counts, prefix caching.

The block manager counts; the scheduler decides. A block is `block_size` token slots in every
layer's K and V pool (and in the draft model's pool, which shares the block ids).

Prefix caching: a full block is identified by a chained hash of (parent block's hash, its tokens).
A freed block keeps its hash and stays findable until it is handed out again, so a later request
with the same prefix reuses it (the tokens are compared on a hit, so a hash collision is harmless).
Free blocks are handed out least recently freed first.

Past its last whole cached block a prompt may still share the head of a cached block: the same
prompt again, whose last block the earlier request filled with its answer, or the next turn of a
chat. Those tokens are reused too (token by token, as llama.cpp's and SGLang's caches do), by
copy: the request's own next block gets the cached block's first K/V rows before its first step
reads them (`take_copies`; the runner copies them ahead of the step's forward), since the request
writes its own tokens after them and the cached block must stay as it is.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice

from backend.core.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold num_tokens tokens."""
    return (num_tokens + block_size - 1) // block_size


PARTIAL_CANDIDATES = 64  # cached blocks under one parent compared for a shared head, newest first


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    parent_hash: int | None = None  # the chain hash before it, while registered


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.children: dict[int | None, dict[int, None]] = {}  # parent hash -> blocks registered under it
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
            self._take(block_id)
        request.block_table = hits
        request.num_cached_blocks = len(hits)
        request.cached_chain_hash = parent
        num_hit = len(hits) * self.block_size
        head = self._shared_head(parent, tokens, num_hit)
        if head is not None:
            self._take(head[0])  # held until take_copies has the copy made
            request.block_copy = head
            num_hit += head[1]
        self.prefix_query_tokens += len(tokens)
        self.prefix_hit_tokens += num_hit
        return num_hit

    def _shared_head(self, parent: int | None, tokens: list[int], start: int) -> tuple[int, int] | None:
        """The cached block under `parent` whose first tokens are the most of tokens[start:] (at
        least one token left to compute), and how many; None when none shares even one."""
        limit = min(self.block_size, len(tokens) - 1 - start)
        best: tuple[int, int] | None = None
        if limit <= 0:
            return None
        want = tokens[start : start + limit]
        for block_id in islice(reversed(self.children.get(parent, {})), PARTIAL_CANDIDATES):
            cached = self.blocks[block_id].token_ids
            n = 0
            while n < limit and cached[n] == want[n]:
                n += 1
            if n and (best is None or n > best[1]):
                best = (block_id, n)
                if n == limit:
                    break
        return best

    def take_copies(self, requests: list[Request]) -> list[tuple[int, int, int]]:
        """The block copies this step's requests need first, as (source, destination, tokens):
        each shared head found by match_prefix goes into the request's own next block. The
        sources are let go here: nothing can hand them out again before the step that copies
        them is launched, and every later step runs after it."""
        copies = []
        for request in requests:
            if request.block_copy is None:
                continue
            source, n = request.block_copy
            request.block_copy = None
            copies.append((source, request.block_table[request.num_cached_blocks], n))
            self._release(source)
        return copies

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

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
            chained = self.chain_hash(parent, chunk)
            block = self.blocks[request.block_table[i]]
            # an identical block may already be cached (computed by another request): keep it
            if block.block_hash is None and chained not in self.hash_to_block_id:
                block.block_hash, block.token_ids, block.parent_hash = chained, chunk, parent
                self.hash_to_block_id[chained] = block.block_id
                self.children.setdefault(parent, {})[block.block_id] = None
            parent = chained
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
                siblings = self.children.get(block.parent_hash)
                if siblings is not None:
                    siblings.pop(block_id, None)
                    if not siblings:
                        del self.children[block.parent_hash]
                block.block_hash = None
                block.token_ids = ()
                block.parent_hash = None
            block.ref_count = 1
            request.block_table.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Release all the request's blocks (finish, abort, preemption). The last blocks are
        queued first so that a prefix's head stays cached longest."""
        for block_id in reversed(request.block_table):
            self._release(block_id)
        if request.block_copy is not None:  # matched, then not scheduled after all
            self._release(request.block_copy[0])
            request.block_copy = None
        request.block_table = []
        request.num_cached_blocks = 0
        request.cached_chain_hash = None

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks past those needed for `num_tokens` (after rejected draft tokens)."""
        keep = self.blocks_needed(num_tokens)
        while len(request.block_table) > keep:
            self._release(request.block_table.pop())

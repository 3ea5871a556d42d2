"""Block accounting: exact block ids and ref counts through allocate / prefix hit / free / preempt."""
from backend.core.block_manager import BlockManager
from backend.core.request import Request
from backend.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_allocate_in_order_and_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(10)))
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0]
    b = make_request("b", list(range(8)))
    assert not bm.allocate(b, 8)  # needs 2, only 1 free: nothing taken
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(a, 12) and a.block_table == [0, 1, 2]  # still fits in 3 blocks
    assert bm.allocate(a, 13) and a.block_table == [0, 1, 2, 3]
    bm.free(a)
    assert refs(bm) == [0, 0, 0, 0] and bm.num_free_blocks == 4


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(a) == 0
    assert bm.allocate(a, 9) and a.block_table == [0, 1, 2]
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full
    assert a.num_cached_blocks == 2
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    assert bm.match_prefix(b) == 8
    assert b.block_table == [0, 1]
    assert refs(bm)[:3] == [2, 2, 1]
    assert bm.allocate(b, 10) and b.block_table == [0, 1, 3]
    # a different first block: no hit, even though the second block's tokens match
    c = make_request("c", [9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert bm.match_prefix(c) == 0
    bm.free(a)
    assert refs(bm)[:4] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.num_free_blocks == 8
    # freed cached blocks stay findable until handed out again
    d = make_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.match_prefix(d) == 8 and d.block_table == [0, 1]
    bm.free(d)
    assert bm.num_free_blocks == 8


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    # the last block is shared but for its last token, which gives the logits: 3 of its rows are
    # copied into b's own block, and block 1 is held until the copy is taken
    assert bm.match_prefix(b) == 7
    assert b.block_table == [0] and b.block_copy == (1, 3) and refs(bm)[:2] == [1, 1]
    assert bm.allocate(b, 8) and b.block_table == [0, 2]
    assert bm.take_copies([b]) == [(1, 2, 3)]
    assert b.block_copy is None and refs(bm) == [1, 0, 1, 0]
    assert bm.take_copies([b]) == []


def test_eviction_reuses_least_recently_freed_and_forgets_hash():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_request("a", [1, 2, 3])
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.free(a)  # frees block 1 then block 0: block 1 is handed out first
    assert list(bm.free_block_ids) == [1, 0]
    b = make_request("b", [7, 7, 7])
    bm.allocate(b, 3)
    assert b.block_table == [1, 0]
    assert bm.hash_to_block_id == {} and bm.children == {}  # block 0 (the cached one) was evicted on reuse
    bm.free(b)


def test_trim_frees_blocks_of_rejected_tokens():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    bm.allocate(a, 7)
    assert a.block_table == [0, 1, 2, 3]
    bm.trim(a, 4)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 2


def cached(bm: BlockManager, rid: str, tokens: list[int]) -> Request:
    """A request whose tokens were all computed, its full blocks cached, then finished."""
    r = make_request(rid, tokens)
    bm.match_prefix(r)
    bm.take_copies([r]) if bm.allocate(r, len(tokens)) else None
    r.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(r)
    bm.free(r)
    return r


def test_the_same_prompt_again_reuses_its_last_block_token_by_token():
    """An answer filled the prompt's last block: the same prompt again shares all of it but the
    token that gives the logits, the full blocks by reference, the last one's head by copy."""
    bm = BlockManager(num_blocks=8, block_size=4)
    cached(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50, 51])  # prompt of 10, then 2 answer tokens
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert bm.match_prefix(b) == 9
    assert b.block_table == [0, 1] and b.block_copy == (2, 1)
    assert bm.prefix_hit_tokens == 9 and bm.prefix_query_tokens == 12 + 10
    assert bm.allocate(b, 10) and b.block_table == [0, 1, 3]
    assert bm.take_copies([b]) == [(2, 3, 1)]
    assert refs(bm) == [1, 1, 0, 1, 0, 0, 0, 0]


def test_the_longest_shared_head_wins_and_one_token_is_left():
    bm = BlockManager(num_blocks=8, block_size=4)
    cached(bm, "a", [1, 2, 3, 4, 5, 6, 60, 61])
    cached(bm, "b", [1, 2, 3, 4, 5, 6, 7, 70])
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(c) == 4 + 3 and c.block_copy[1] == 3  # a's block shares 2, b's 3
    assert bm.blocks[c.block_copy[0]].token_ids == (5, 6, 7, 70)
    d = make_request("d", [1, 2, 3, 4, 5, 6])  # the whole prompt shared: its last token is computed
    assert bm.match_prefix(d) == 5 and d.block_copy[1] == 1
    e = make_request("e", [1, 2, 3, 4, 9, 9])  # the next block shares nothing
    assert bm.match_prefix(e) == 4 and e.block_copy is None


def test_a_matched_request_not_scheduled_lets_its_copy_source_go():
    bm = BlockManager(num_blocks=4, block_size=4)
    cached(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 9])
    assert bm.match_prefix(b) == 6 and refs(bm) == [1, 1, 0, 0]
    bm.free(b)  # no room after all, or aborted while waiting
    assert b.block_copy is None and refs(bm) == [0, 0, 0, 0] and bm.num_free_blocks == 4


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    cached(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match_prefix(b) == 0 and b.block_copy is None and bm.children == {}

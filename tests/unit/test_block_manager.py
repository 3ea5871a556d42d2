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
    assert bm.match_prefix(b) == 4  # the last block is recomputed: its last token gives logits
    assert b.block_table == [0] and refs(bm)[0] == 1


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
    assert bm.hash_to_block_id == {}  # block 0 (the cached one) was evicted on reuse
    bm.free(b)


def test_trim_frees_blocks_of_rejected_tokens():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    bm.allocate(a, 7)
    assert a.block_table == [0, 1, 2, 3]
    bm.trim(a, 4)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 2

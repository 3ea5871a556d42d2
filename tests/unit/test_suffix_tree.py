"""Suffix trees against a brute-force reference that counts substrings in the raw sequences, and
the suffix proposer's two trees: a request's own and the bounded global one."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.request import Request, RequestStatus
from backend.sampling_params import SamplingParams
from backend.speculative.suffix_proposer import SuffixProposer
from backend.speculative.suffix_tree import SuffixTree


def occurrences(sequences: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(seq[i : i + n] == pattern for seq in sequences for i in range(len(seq) - n + 1))


def reference_draft(sequences, context, max_tokens, factor, min_prob, depth):
    """The rule of suffix_tree.py, from occurrence counts: (tokens, probs) of the best draft."""
    best_tokens, best_probs, best_score = [], [], 0.0
    for m in range(1, min(len(context), depth - 1) + 1):
        pattern = context[len(context) - m:]
        if not occurrences(sequences, pattern):
            break
        limit = min(max_tokens, int(m * factor + 1e-6), depth - m)
        tokens, probs, prob, current = [], [], 1.0, pattern
        while len(tokens) < limit:
            counts = {t: occurrences(sequences, current + [t]) for t in {t for s in sequences for t in s}}
            token = max(counts, key=lambda t: (counts[t], -t))
            if not counts[token]:
                break
            prob *= counts[token] / occurrences(sequences, current)
            if prob < min_prob:
                break
            tokens, probs, current = tokens + [token], probs + [prob], current + [token]
        if sum(probs) > best_score:
            best_tokens, best_probs, best_score = tokens, probs, sum(probs)
    return best_tokens, best_probs


small_tokens = st.lists(st.integers(0, 3), min_size=1, max_size=40)  # 4 tokens: much repeats


@settings(max_examples=300, deadline=None)
@given(sequences=st.lists(small_tokens, min_size=1, max_size=3), context=small_tokens,
       depth=st.integers(2, 9), max_tokens=st.integers(0, 8), factor=st.sampled_from([0.5, 1.0, 2.0]),
       min_prob=st.sampled_from([0.0, 0.1, 0.4]), cut=st.integers(0, 40))
def test_drafts_and_counts_match_brute_force(sequences, context, depth, max_tokens, factor, min_prob, cut):
    tree = SuffixTree(depth)
    for i, seq in enumerate(sequences):  # added in two pieces: appending continues the same suffixes
        tree.extend(i, seq[:cut])
        tree.extend(i, seq[cut:])
    assert tree.num_tokens == sum(map(len, sequences))
    for n in range(1, depth + 1):
        pattern = context[:n]
        node = tree.match(pattern)
        expected = occurrences(sequences, pattern)
        assert (tree.counts[node] if node is not None else 0) == expected
    draft = tree.speculate(context, max_tokens, factor, min_prob)
    tokens, probs = reference_draft(sequences, context, max_tokens, factor, min_prob, depth)
    assert draft.token_ids == tokens
    assert draft.probs == probs  # (the same products in the same order)
    assert draft.score == sum(probs)


@settings(max_examples=100, deadline=None)
@given(seq=small_tokens, depth=st.integers(2, 9), max_tokens=st.integers(1, 8))
def test_a_sequences_own_suffix_nodes_are_its_matches(seq, depth, max_tokens):
    """The nodes a sequence's appends leave active are what matching its context would find."""
    tree = SuffixTree(depth)
    tree.extend("s", seq)
    nodes = tree.suffix_nodes("s")
    assert nodes == [tree.match(seq[len(seq) - m:]) for m in range(1, min(len(seq), depth - 1) + 1)]
    assert tree.speculate(seq, max_tokens) == tree.speculate([], max_tokens, nodes=nodes)


def test_a_longer_match_earns_a_longer_draft():
    """Draft length is capped by the match (factor 1): one token matched drafts one token."""
    tree = SuffixTree(24)
    tree.extend(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert tree.speculate([9, 9, 1], 8).token_ids == [2]
    assert tree.speculate([1, 2, 3], 8).token_ids == [4, 5, 6]
    assert tree.speculate([1, 2, 3], 2).token_ids == [4, 5]  # and by k
    assert tree.speculate([0, 0, 0], 8).token_ids == []


def _request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    request = Request(rid, list(prompt), SamplingParams(temperature=0.0))
    request.output_token_ids.extend(output)
    return request


def test_a_request_drafts_from_its_own_prompt_and_output():
    proposer = SuffixProposer()
    code = list(range(100, 130))
    request = _request("a", code + [7] + code[:5])
    assert proposer.draft(request, 4).token_ids == code[5:9]  # what followed in the prompt
    request.output_token_ids.extend(code[5:20] + [50, 51, 52])
    assert proposer.num_available(request, 16) == 0  # [50, 51, 52] occurred nowhere before
    request.output_token_ids.extend([7, 8] + [50, 51])
    assert proposer.draft(request, 3).token_ids == [52, 7]  # from its own output; 2 matched, 2 drafted
    request.output_token_ids.extend([1, 2, 3, 4, 1, 9, 1])  # after [1]: 2 or 9, each 1 in 3
    assert proposer.num_available(request, 4) == 0  # expected to keep less than one token
    assert SuffixProposer(min_draft_score=0.0).draft(request, 4).token_ids == [2]


def test_the_global_tree_drafts_what_an_earlier_request_wrote_and_stays_bounded():
    proposer = SuffixProposer(global_max_tokens=64)
    answer = list(range(200, 230))
    first = _request("first", [1, 2, 3], answer)
    proposer.num_available(first, 4)  # its output goes to the global tree as it is seen
    first.status = RequestStatus.FINISHED_STOPPED
    second = _request("second", [9, 9] + answer[:6])
    assert proposer.draft(second, 5).token_ids == answer[6:11]
    assert "first" not in proposer.trees  # finished: its own tree is gone, its output stays global
    for i in range(10):  # outputs past the bound: the newest half of it is kept
        proposer.num_available(_request(f"r{i}", [0], [300 + i] * 20), 4)
    assert proposer.global_tree.num_tokens <= 64
    assert "r9" in proposer.global_tree.sequences and "first" not in proposer.global_tree.sequences

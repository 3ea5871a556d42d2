"""A depth-bounded suffix tree with counts, over several token sequences (SuffixDecoding,
Oliaro et al., arXiv 2411.04975; the same trees as Snowflake's Arctic Inference, written here
because `arctic-inference` ships its tree only as C++ in a source distribution, built with CMake
against torch >= 2.10 as a vLLM plugin).

Every substring of length at most `max_depth` of every sequence is a path from the root; a node's
count is how many times its substring occurs. Appending a token extends the paths of the suffixes
that end at the sequence's last token (at most max_depth of them), so a sequence of n tokens costs
O(n max_depth). Counts only grow, so each node keeps its most frequent child as they do (the
smallest token on a tie). The edges are one dict of ints (no object per node for the garbage
collector to walk).

Drafting (`speculate`): for each match length m = 1, 2, ... while the context's last m tokens are
a path, follow the most frequent child from there, each draft token's probability being
count(child) / count(parent) times the one before it, until it falls below `min_token_prob` or the
draft holds min(max_tokens, floor(max_spec_factor * m)) tokens (a longer match earns a longer
draft). A draft's score is the sum of its tokens' probabilities (its expected accepted tokens);
the best score wins, the shorter match on a tie (so a match whose cap is no more than the best
score so far need not be looked at: a draft scores at most its length).
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROOT = 0  # node id of the empty substring
EDGE_KEY = 1 << 32  # an edge's key: its parent node id times this, plus its token


@dataclass(slots=True)
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated probability of each draft token's prefix
    score: float = 0.0  # sum of probs: the draft's expected accepted tokens
    match_len: int = 0  # context tokens matched before the draft


@dataclass(slots=True)
class _Sequence:
    token_ids: list[int] = field(default_factory=list)
    # nodes of the suffixes that end at its last token and can still grow, by depth 1, 2, ...
    active: list[int] = field(default_factory=list)


class SuffixTree:
    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.edges: dict[int, int] = {}  # node id * EDGE_KEY + token -> child node id
        self.counts: list[int] = [0]  # node id -> occurrences of its substring
        self.best_child: list[int] = [-1]  # node id -> its most frequent child (-1: a leaf)
        self.best_token: list[int] = [-1]  # node id -> the token to that child
        self.sequences: dict[object, _Sequence] = {}  # sequence id -> its tokens, in insertion order
        self.num_tokens = 0  # over every sequence

    def __len__(self) -> int:
        return len(self.sequences)

    def extend(self, seq_id: object, token_ids: list[int]) -> None:
        """Append tokens to a sequence (a new one if the id is new)."""
        seq = self.sequences.get(seq_id)
        if seq is None:
            seq = self.sequences[seq_id] = _Sequence()
        edges, counts, best_child, best_token = self.edges, self.counts, self.best_child, self.best_token
        keep = self.max_depth - 1
        active = seq.active
        for token in token_ids:
            grown = []
            for node in (ROOT, *active):
                key = node * EDGE_KEY + token
                child = edges.get(key)
                if child is None:
                    child = edges[key] = len(counts)
                    counts.append(0)
                    best_child.append(-1)
                    best_token.append(-1)
                count = counts[child] = counts[child] + 1
                best = best_child[node]
                if best != child and (best < 0 or count > counts[best] or (count == counts[best] and token < best_token[node])):
                    best_child[node], best_token[node] = child, token
                grown.append(child)
            active = grown[:keep]  # a node at max_depth cannot grow
        seq.active = active
        seq.token_ids.extend(token_ids)
        self.num_tokens += len(token_ids)

    def match(self, pattern: list[int]) -> int | None:
        """The node of `pattern`, None if it does not occur."""
        node, edges = ROOT, self.edges
        for token in pattern:
            node = edges.get(node * EDGE_KEY + token)
            if node is None:
                return None
        return node

    def suffix_nodes(self, seq_id: object) -> list[int]:
        """The nodes of a sequence's last 1, 2, ... tokens (up to max_depth - 1 of them): the
        matches `speculate` looks for when that sequence is the context, without looking."""
        return self.sequences[seq_id].active

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, nodes: list[int] | None = None) -> Draft:
        """The best-scoring draft to follow `context` (module docstring), at most max_tokens long;
        `nodes`: the context's matches when known (`suffix_nodes`)."""
        best = Draft()
        counts, best_child, best_token = self.counts, self.best_child, self.best_token
        longest = len(nodes) if nodes is not None else min(len(context), self.max_depth - 1)
        for match_len in range(1, longest + 1):
            limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6), self.max_depth - match_len)
            if limit <= best.score:  # a draft scores at most its length
                if match_len * max_spec_factor >= max_tokens:
                    break  # and no longer match may draft more
                continue
            node = nodes[match_len - 1] if nodes is not None else self.match(context[len(context) - match_len:])
            if node is None:
                break  # no longer match occurs either
            draft, prob = Draft(match_len=match_len), 1.0
            while len(draft.token_ids) < limit and best_child[node] >= 0:
                child = best_child[node]
                prob *= counts[child] / counts[node]
                if prob < min_token_prob:
                    break
                draft.token_ids.append(best_token[node])
                draft.probs.append(prob)
                draft.score += prob
                node = child
            if draft.score > best.score:
                best = draft
        return best

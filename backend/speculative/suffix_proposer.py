"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from suffix trees, no draft model.

Two trees (suffix_tree.py): one per request over its prompt and output, and one global tree over
the outputs of recent requests, bounded in tokens (the oldest outputs leave first). Agent traffic
repeats what it read (a file it edits, a tool result it quotes) and what it wrote before (a call
shaped like the last), so the match with the context's last tokens often runs long, and the
draft may too: its length is capped by the match length (a factor of it, as the paper does) and
by k, and stops where the tree's estimate that the draft is still right falls below
`min_token_prob`. The better-scoring tree's draft is proposed (the request's on a tie), if its
score (the tokens it is expected to keep) is at least `min_draft_score`: a verified draft token
costs a little even where it is rejected (on a CPU, about what a token of the batch costs), and
plain chat matches only short, uncertain runs, which would cost more than they keep.

The trees see only tokens on the host: a request whose last tokens are still on the device
(overlapped steps) gets no draft that step. Drafts are deterministic (a one-hot draft
distribution for the rejection sampler), so a seeded request's tokens do not depend on them: its
verification keeps the target's keyed samples (backend/sample/seeded_noise.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.core.request import Request
from backend.core.spec_state import Proposal
from backend.model.step_inputs import PendingTokens
from backend.speculative.suffix_tree import Draft, SuffixTree
from backend.step_timer import StepTimer

MAX_TREE_DEPTH = 24  # longest substring the trees hold (match plus draft); vLLM's default
MAX_SPEC_FACTOR = 1.0  # a match of m tokens earns a draft of at most m tokens
MIN_TOKEN_PROB = 0.1  # stop drafting where the estimated probability falls below this
GLOBAL_MAX_TOKENS = 1 << 14  # outputs the global tree holds, oldest out first
MIN_DRAFT_SCORE = 1.0  # no draft expected to keep less than one token


@dataclass(slots=True)
class _RequestTree:
    request: Request
    tree: SuffixTree  # over its prompt and output
    num_added: int = 0  # its tokens in the tree so far
    draft: Draft | None = None  # the last draft, for num_tokens ...
    drafted_at: int = -1  # ... tokens of context, for as many as `max_drafted` asked
    max_drafted: int = 0


class SuffixProposer:
    runner = None  # a lookup: no forward, nothing to catch up on

    def __init__(self, max_depth: int = MAX_TREE_DEPTH, max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB, global_max_tokens: int = GLOBAL_MAX_TOKENS,
                 min_draft_score: float = MIN_DRAFT_SCORE):
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_max_tokens = global_max_tokens
        self.min_draft_score = min_draft_score
        self.global_tree = SuffixTree(max_depth)  # over recent outputs: request id -> its output
        self.trees: dict[str, _RequestTree] = {}  # request id -> its tree, while it is not finished
        self.num_proposals = 0  # drafts proposed ...
        self.num_global = 0  # ... of which from the global tree

    def num_available(self, request: Request, k: int) -> int:
        if request.num_pending_tokens:  # its last tokens are still on the device (overlapped steps)
            return 0
        return min(len(self.draft(request, k).token_ids), k)

    def propose(self, requests: list[Request], ks: list[int], timer: StepTimer | None = None,
                catch_up: list[tuple[Request, int]] = (), pending: PendingTokens | None = None) -> list[Proposal]:
        return [Proposal(self.draft(r, k).token_ids[:k], None) for r, k in zip(requests, ks)]

    def draft(self, request: Request, k: int) -> Draft:
        """The better of the two trees' drafts after the request's tokens, at most k long (the last
        one again when nothing moved since)."""
        state = self._sync(request)
        num_tokens = request.num_tokens
        if state.drafted_at == num_tokens and state.max_drafted >= k:
            return state.draft
        args = (k, self.max_spec_factor, self.min_token_prob)
        draft = state.tree.speculate([], *args, nodes=state.tree.suffix_nodes(request.request_id))
        if len(self.global_tree):
            context = request.tokens_slice(max(num_tokens - self.max_depth, 0), num_tokens)
            other = self.global_tree.speculate(context, *args)
            if other.score > draft.score:
                draft = other
                self.num_global += 1
        if draft.score < self.min_draft_score:
            draft = Draft()
        self.num_proposals += 1
        state.draft, state.drafted_at, state.max_drafted = draft, num_tokens, k
        return draft

    def _sync(self, request: Request) -> _RequestTree:
        """Add the request's new tokens to its tree, and its new output tokens to the global tree."""
        state = self.trees.get(request.request_id)
        if state is None:
            self.forget_finished()
            state = self.trees[request.request_id] = _RequestTree(request, SuffixTree(self.max_depth))
        num_tokens, num_prompt = request.num_tokens, request.num_prompt_tokens
        if state.num_added < num_tokens:
            state.tree.extend(request.request_id, request.tokens_slice(state.num_added, num_tokens))
            start = max(state.num_added, num_prompt)
            if start < num_tokens:
                self._add_output(request.request_id, request.tokens_slice(start, num_tokens))
            state.num_added = num_tokens
        return state

    def _add_output(self, request_id: str, token_ids: list[int]) -> None:
        """Counts only grow: past its bound the global tree is built again from the newest outputs
        that fill half of it (O(max_depth) per token, amortized, as adding them was)."""
        self.global_tree.extend(request_id, token_ids)
        if self.global_tree.num_tokens <= self.global_max_tokens:
            return
        kept, room = [], self.global_max_tokens // 2
        for rid, seq in reversed(self.global_tree.sequences.items()):  # newest first
            if room <= 0:
                break
            kept.append((rid, seq.token_ids[-room:]))
            room -= len(kept[-1][1])
        self.global_tree = SuffixTree(self.max_depth)
        for rid, token_ids in reversed(kept):
            self.global_tree.extend(rid, token_ids)

    def forget_finished(self) -> None:
        """Drop the trees of requests that are gone; their outputs' last tokens (after their last
        draft) join the global tree first."""
        for rid, state in list(self.trees.items()):
            request = state.request
            if request.is_finished:
                start = max(state.num_added, request.num_prompt_tokens)
                if start < request.num_tokens:
                    self._add_output(rid, request.tokens_slice(start, request.num_tokens))
                del self.trees[rid]

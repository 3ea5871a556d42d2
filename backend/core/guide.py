"""A constrained request's grammar state: which tokens may come next (xgrammar's GrammarMatcher).

The state advances when the request's tokens land on the host (OutputProcessor), so when a step
is sampled it stands after every token the request has (engine.py: a request's earlier step is
read back before its next one is sampled, with overlapped steps and pipeline batches too).
`fill_rows` writes the allowed-token bitmask of the request's rows for that step: row 0 at the
current state; with k draft tokens d_1..d_k to verify, row i at the state after d_1..d_i,
accepted tentatively and rolled back afterwards. A draft the grammar refuses ends the walk: the
rows after it are left all-allowed, and are never used (the sampler rejects that draft, since its
masked probability is 0, so no token comes from a later row); so are the rows after a draft that
ends the grammar (a stop token: the request ends there). A request whose grammar has ended (its
EOS landed, its row wasted in an overlapped step) keeps an all-allowed row.
"""
from __future__ import annotations

import torch
import xgrammar


_BATCH = xgrammar.BatchGrammarMatcher()  # fills many rows at once, on as many threads as the host has


def fill_masks(bitmask: torch.Tensor, rows: list[tuple[Guide, int, list[int]]]) -> None:
    """Every constrained request's rows of a step: (its guide, its first row, its drafts). The
    rows without drafts (most) are filled in one call across the host's cores."""
    plain = [(guide, row) for guide, row, drafts in rows if not drafts and not guide.is_terminated]
    if plain:
        _BATCH.batch_fill_next_token_bitmask([guide.matcher for guide, _ in plain], bitmask, [row for _, row in plain])
    for guide, row, drafts in rows:
        if drafts:
            guide.fill_rows(bitmask, row, drafts)


class GuideError(RuntimeError):
    """A token landed that the grammar does not allow (the mask would have excluded it)."""


class Guide:
    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self.matcher = xgrammar.GrammarMatcher(compiled)

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """bitmask: [rows, ceil(vocab / 32)] int32, all-allowed (-1) where not written; this
        request's rows are first_row .. first_row + len(drafts)."""
        matcher = self.matcher
        tentative = 0
        for i in range(len(drafts) + 1):
            if matcher.is_terminated():  # a draft was a stop token: nothing comes after it
                break
            matcher.fill_next_token_bitmask(bitmask, first_row + i)
            if i == len(drafts) or not matcher.accept_token(drafts[i]):
                break
            tentative += 1
        if tentative:
            matcher.rollback(tentative)

    def accept(self, token: int) -> None:
        """A token of the request's output landed."""
        if not self.matcher.accept_token(token):
            raise GuideError(f"token {token} is not allowed by the request's grammar here")

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (a stop token accepted)."""
        return self.matcher.is_terminated()

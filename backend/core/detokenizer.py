"""Incremental detokenization with stop strings.

Tokens are decoded with a sliding window (prefix/read offsets): the text of
ids[prefix_offset:] minus the text of ids[prefix_offset:read_offset] is the new text, released
only when it does not end in an incomplete UTF-8 sequence (U+FFFD). Starting the window a few
tokens back keeps the leading space a byte-level BPE puts on a word. Special tokens decode to
nothing (skip_special_tokens).

Each output token owns the text it added: `text[token_ends[i - 1]:token_ends[i]]` ("" for a token
whose bytes complete only with a later one, and for a special token), so a token's logprob entry
spells exactly its part of the text, with the same spaces (`token_texts`), and `candidate_texts`
spells what other tokens would have added in its place.

Stop strings: the text is cut where the first stop string begins, and the tokens that carry it
own only what is left of theirs. While a request runs, the longest tail of the text that could
still grow into a stop string is held back, so a stream never shows text that is later cut. Text
is handed out a whole token at a time, so that each delta is the text of the tokens it hands out.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own decoder
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""  # the output text so far (cut at a stop string)
        self.token_ends: list[int] = []  # output token i -> where its text ends in `text`
        self.num_emitted = 0  # characters of `text` already handed out
        self.num_emitted_tokens = 0  # output tokens whose text is handed out

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _added_text(self, window: list[int], prefix_text: str) -> str:
        """What the last token of `window` (ids[prefix_offset:] plus it) adds to the text; "" while
        it ends in an incomplete UTF-8 sequence."""
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return new_text[len(prefix_text) :]

    def candidate_texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text each of these tokens would add as the next output token (call before add_token)."""
        window = self.ids[self.prefix_offset :]
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        return {t: self._added_text([*window, t], prefix_text) for t in token_ids}

    def add_token(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string has now appeared (text is cut)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        added = self._added_text(self.ids[self.prefix_offset :], prefix_text)
        start = len(self.text)
        if added:
            self.text += added
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.token_ends.append(len(self.text))
        return bool(added) and self._cut_at_stop(start)

    def _cut_at_stop(self, new_from: int) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        search_from = max(0, new_from - longest + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        for i in range(len(self.token_ends) - 1, -1, -1):  # the tokens that carry the stop string
            if self.token_ends[i] <= len(self.text):
                break
            self.token_ends[i] = len(self.text)
        return True

    def _held_back(self) -> int:
        """Characters at the end of `text` that are a proper prefix of some stop string."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet that is safe to hand out now, up to the end of a token:
        the text of the tokens from `num_emitted_tokens` (before the call) to `num_emitted_tokens`."""
        if finished:
            self.num_emitted_tokens = len(self.token_ends)
        else:
            safe = len(self.text) - self._held_back()
            self.num_emitted_tokens = max(self.num_emitted_tokens, bisect.bisect_right(self.token_ends, safe))
        end = self.token_ends[self.num_emitted_tokens - 1] if self.num_emitted_tokens else 0
        delta = self.text[self.num_emitted : end]
        self.num_emitted = max(self.num_emitted, end)
        return delta

    def token_texts(self, start: int, end: int) -> list[str]:
        """The text of output tokens [start, end), each its own part of `text`."""
        ends = self.token_ends[start:end]
        begins = [self.token_ends[start - 1] if start else 0, *ends[:-1]]
        return [self.text[b:e] for b, e in zip(begins, ends)]

"""Incremental detokenization with stop strings.

Tokens are decoded with a sliding window (prefix/read offsets): the text of
ids[prefix_offset:] minus the text of ids[prefix_offset:read_offset] is the new text, released
only when it does not end in an incomplete UTF-8 sequence (U+FFFD). Starting the window a few
tokens back keeps the leading space a byte-level BPE puts on a word.

Stop strings: the text is cut where the first stop string begins. While a request runs, the
longest tail of the text that could still grow into a stop string is held back, so a stream never
shows text that is later cut.
"""
from __future__ import annotations

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
        self.num_emitted = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string has now appeared (text is cut)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._cut_at_stop(start)

    def _cut_at_stop(self, new_from: int) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        search_from = max(0, new_from - longest + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
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
        """The text not handed out yet that is safe to hand out now."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta

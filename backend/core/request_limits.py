"""What a request must satisfy to be taken: the engine's vocabulary, context and KV pool.

Checked where a request arrives (the engine, or a client of an engine in another process, which
gets these limits when the engine starts), so a bad request is refused at once.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.core.block_manager import blocks_needed
from backend.core.grammar_compiler import GrammarCompiler
from backend.errors import ValidationError
from backend.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    eos_token_ids: tuple[int, ...] = ()  # a constraint's stop tokens (guided decoding)

    def validate(self, prompt_ids: list[int], params: SamplingParams, grammars: GrammarCompiler | None = None) -> None:
        """Raises ValidationError. With `grammars`, a guided-decoding constraint is compiled too (in
        the caller's thread; cached for the engine's add_request), so a bad one is refused here."""
        if not prompt_ids:
            raise ValidationError("prompt_token_ids", "the prompt is empty")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValidationError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValidationError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValidationError(
                "prompt_token_ids", f"prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len}"
            )
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValidationError(
                "max_tokens",
                f"must be in [1, {self.max_model_len - len(prompt_ids)}] for this {len(prompt_ids)}-token "
                f"prompt (context {self.max_model_len}), got {params.max_tokens}",
            )
        need = blocks_needed(len(prompt_ids) + params.max_tokens, self.block_size)
        if need > self.num_blocks:
            raise ValidationError(
                "max_tokens", f"prompt + max_tokens needs {need} KV blocks; the pool has {self.num_blocks}"
            )
        if grammars is not None and params.guided_decoding is not None:
            grammars.compile(params.guided_decoding)

"""Text or chat messages -> token ids, validated SamplingParams and request options.

The work of the `preprocessing` model, shared with `llm`, which runs it in its own process. Plain
Python (no Triton imports): inputs arrive as a dict of name -> numpy array, every problem is a
ValidationError that names the input.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jinja2 import TemplateError
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from backend.errors import ValidationError
from backend.sampling_params import SamplingParams
from serving.triton.request_inputs import RequestOptions, parse_request

DEFAULT_TOKENIZER = "llm_engine/1/target"  # relative to the model repository


@dataclass(slots=True)
class PreprocessedRequest:
    input_ids: list[int]
    params: SamplingParams
    options: RequestOptions
    prompt: str  # the prompt as text (chat rendered), echoed when exclude_input_in_output is false

    def engine_inputs(self, in_band_errors: bool = False) -> dict[str, np.ndarray]:
        """The inputs of llm_engine, by name. `in_band_errors`: llm_engine ends the request with
        an `error` output instead of an error response (what llm_bls asks for, see llm_engine)."""
        options = json.loads(self.options.to_json()) | ({"in_band_errors": True} if in_band_errors else {})
        return {
            "input_ids": np.asarray(self.input_ids, dtype=np.int32),
            "sampling_params": text_tensor(json.dumps(self.params.to_dict())),
            "request_options": text_tensor(json.dumps(options)),
            "prompt_text": text_tensor(self.prompt),
        }


class Preprocessor:
    def __init__(self, tokenizer_dir: Path, max_model_len: int):
        self.tokenizer_dir = _local_dir(tokenizer_dir)
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        self.max_model_len = max_model_len
        # no prompt longer than this can fit the context: it is refused before tokenizing
        self.max_prompt_bytes = max_model_len * _longest_token_bytes(self.tokenizer)

    @classmethod
    def from_parameters(cls, parameters: dict[str, str], repository: Path) -> Preprocessor:
        """`parameters`: a model config's `tokenizer` (relative to `repository`, the model
        repository) and `max_model_len` (empty: the tokenizer directory's config.json)."""
        tokenizer_dir = Path(parameters.get("tokenizer", DEFAULT_TOKENIZER))
        if not tokenizer_dir.is_absolute():
            tokenizer_dir = repository / tokenizer_dir
        tokenizer_dir = _local_dir(tokenizer_dir)
        max_model_len = _max_model_len(tokenizer_dir, parameters.get("max_model_len", ""))
        return cls(tokenizer_dir, max_model_len)

    def __call__(self, inputs: dict[str, np.ndarray], parameters: dict | None = None) -> PreprocessedRequest:
        """`parameters`: the request's Triton parameters (sampling values, as vllm_backend reads them)."""
        parsed = parse_request(inputs, self._render_chat, self.max_prompt_bytes, parameters)
        input_ids = self.tokenizer(parsed.prompt, add_special_tokens=not parsed.from_messages)[
            "input_ids"
        ]
        prompt_field = "messages" if parsed.from_messages else "text_input"
        if not input_ids:
            raise ValidationError(prompt_field, "the prompt tokenizes to no tokens")
        if len(input_ids) >= self.max_model_len:
            raise ValidationError(
                prompt_field,
                f"prompt is {len(input_ids)} tokens; the context is {self.max_model_len} tokens "
                "and must also hold at least one generated token",
            )
        return PreprocessedRequest(input_ids, parsed.params, parsed.options, parsed.prompt)

    def _render_chat(self, messages: list[dict]) -> str:
        if not self.tokenizer.chat_template:
            raise ValidationError("messages", "the model's tokenizer has no chat template")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:  # raise_exception(): roles or orders the template refuses
            raise ValidationError("messages", f"the chat template refused them: {str(e)[:200]}") from None


# the classes AutoTokenizer gives for a tokenizer.json alone: both names are TokenizersBackend
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(directory: Path):
    """The tokenizer AutoTokenizer would load from `directory` (local only: a name that is not a
    directory here must never become a hub download). Where that is the generic Rust-backed class,
    it is built directly: AutoTokenizer imports torch to find it, which costs every preprocessing
    and llm process seconds of CPU at start-up and hundreds of MB for as long as it runs."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if (directory / "tokenizer.json").exists() and config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        return TokenizersBackend.from_pretrained(directory, local_files_only=True)
    from transformers import AutoTokenizer  # a model-specific class

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of prompt text one token stands for: the longest token,
    decoded or as written in the vocabulary (a byte-level "Ġ" is 2 bytes for 1, a lone byte
    decodes to 3 bytes of U+FFFD), whichever is longer."""
    ids = list(range(len(tokenizer)))
    # the Rust tokenizer's own batch, ten times faster than transformers' batch_decode (which may
    # also clean up spaces: its strings are never longer, so the bound holds)
    decoded = tokenizer.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    written = tokenizer.convert_ids_to_tokens(ids)
    return max(max(len(d.encode("utf-8")), len((w or "").encode("utf-8"))) for d, w in zip(decoded, written))


def _local_dir(path: Path | str) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {path} is not a directory; the `tokenizer` parameter is a local "
            "directory (absolute, or relative to the model repository), never a Hugging Face hub name"
        )
    return path


def text_tensor(text: str) -> np.ndarray:
    """A one-string BYTES tensor (UTF-8), as the models hand inputs on."""
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _max_model_len(model_dir: Path, override: str) -> int:
    if override.strip():
        return int(override)
    config_path = model_dir / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        config = config.get("text_config", config)
        if "max_position_embeddings" in config:
            return int(config["max_position_embeddings"])
    raise ValueError(f"{config_path} has no max_position_embeddings; set parameter max_model_len")

"""preprocessing: text or chat messages -> input_ids, validated sampling params, request options."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _extend_sys_path() -> None:
    """The stub's embedded interpreter ignores PYTHONPATH (the launcher puts the repo there);
    the repository holding this model repository works without it."""
    here = Path(__file__).resolve().parent
    entries = [str(here), *os.environ.get("PYTHONPATH", "").split(os.pathsep), str(here.parents[2])]
    for entry in reversed(entries):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)


_extend_sys_path()

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from request_inputs import parse_request  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from backend.errors import ValidationError  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        repository = Path(args["model_repository"]).parent  # args name the model's own directory
        tokenizer_dir = Path(parameters.get("tokenizer", "llm_engine/1/target"))
        if not tokenizer_dir.is_absolute():
            tokenizer_dir = repository / tokenizer_dir
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.max_model_len = _max_model_len(tokenizer_dir, parameters.get("max_model_len", ""))
        self.input_names = [i["name"] for i in model_config["input"]]
        pb_utils.Logger.log_info(
            f"preprocessing: tokenizer {tokenizer_dir}, max_model_len {self.max_model_len}"
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._preprocess(request))
            except ValidationError as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses

    def _preprocess(self, request):
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        parsed = parse_request(inputs, self._render_chat)
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
        outputs = [
            pb_utils.Tensor("input_ids", np.asarray(input_ids, dtype=np.int32)),
            _bytes_tensor("sampling_params", json.dumps(parsed.params.to_dict())),
            _bytes_tensor("request_options", parsed.options.to_json()),
            _bytes_tensor("prompt_text", parsed.prompt),
        ]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def _render_chat(self, messages: list[dict]) -> str:
        if not self.tokenizer.chat_template:
            raise ValidationError("messages", "the model's tokenizer has no chat template")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja raises for roles or orders a template refuses
            raise ValidationError("messages", f"the chat template refused them: {e}") from None


def _bytes_tensor(name: str, text: str):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


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

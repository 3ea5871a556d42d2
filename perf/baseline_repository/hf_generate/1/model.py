"""hf_generate: HF transformers `generate` on each batch from Triton's dynamic batcher.

The baseline that perf/sweep_serving.py measures the engine against, built the way the Python
backend's examples build a model: static batches (a batch runs until its longest request is
done, and requests that arrive meanwhile wait for the next batch), no KV cache shared across
batches, one response per request with the whole completion. Requests in a batch that ask for
different max_tokens, temperature or ignore_eos run as separate `generate` calls; a sampled
group is seeded with its first request's seed.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[4]
# the stub's interpreter ignores PYTHONPATH, where the launcher puts this project and its environment
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

DEFAULT_MAX_TOKENS = 16


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        model_dir = Path(params.get("model", "model_repository/llm_engine/1/target"))
        model_dir = model_dir if model_dir.is_absolute() else REPO_ROOT / model_dir
        if int(params.get("num_threads", "0") or 0) > 0:
            torch.set_num_threads(int(params["num_threads"]))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = getattr(torch, params.get("dtype", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        pb_utils.Logger.log_info(f"hf_generate: {model_dir}, {torch.get_num_threads()} threads")

    def execute(self, requests):
        rows = []  # (request index, prompt, (max_tokens, temperature, ignore_eos), seed)
        for i, request in enumerate(requests):
            prompts = _column(request, "text_input")
            n = len(prompts)
            max_tokens = _column(request, "max_tokens", [DEFAULT_MAX_TOKENS] * n)
            temperature = _column(request, "temperature", [1.0] * n)
            ignore_eos = _column(request, "ignore_eos", [False] * n)
            seed = _column(request, "seed", [0] * n)
            for j in range(n):
                key = (int(max_tokens[j]), float(temperature[j]), bool(ignore_eos[j]))
                rows.append((i, prompts[j].decode("utf-8"), key, int(seed[j])))
        results: dict[int, list[tuple]] = {i: [] for i in range(len(requests))}
        for key in dict.fromkeys(row[2] for row in rows):
            group = [row for row in rows if row[2] == key]
            for (i, *_), completion in zip(group, self._generate([r[1] for r in group], *key, group[0][3])):
                results[i].append(completion)
        return [_response(results[i]) for i in range(len(requests))]

    def _generate(self, prompts: list[str], max_tokens: int, temperature: float, ignore_eos: bool, seed: int):
        """[(text, finish_reason, num_input_tokens, num_output_tokens)] for each prompt."""
        batch = self.tokenizer(prompts, return_tensors="pt", padding=True)
        kwargs = dict(max_new_tokens=max_tokens, pad_token_id=self.tokenizer.pad_token_id)
        if ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        if temperature > 0:
            torch.manual_seed(seed)
            kwargs |= dict(do_sample=True, temperature=temperature, top_k=0)
        else:
            kwargs["do_sample"] = False
        with torch.inference_mode():
            output = self.model.generate(**batch, **kwargs)  # [batch, padded prompt + new tokens]
        new_tokens = output[:, batch["input_ids"].shape[1]:].tolist()
        completions = []
        for ids, mask in zip(new_tokens, batch["attention_mask"]):
            finish_reason = "length"
            if not ignore_eos and self.tokenizer.eos_token_id in ids:
                ids, finish_reason = ids[: ids.index(self.tokenizer.eos_token_id)], "stop"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append((text, finish_reason, int(mask.sum()), len(ids)))
        return completions


def _column(request, name: str, default: list | None = None) -> list:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1).tolist()


def _response(completions: list[tuple]):
    texts, reasons, num_in, num_out = zip(*completions)
    strings = lambda values: np.array([[v.encode("utf-8")] for v in values], dtype=np.object_)  # noqa: E731
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", strings(texts)),
        pb_utils.Tensor("finish_reason", strings(reasons)),
        pb_utils.Tensor("num_input_tokens", np.array([[n] for n in num_in], dtype=np.uint32)),
        pb_utils.Tensor("num_output_tokens", np.array([[n] for n in num_out], dtype=np.uint32)),
    ])

"""What the `llm_engine` model reads from a Triton request and its parameters, and the responses and
errors it writes back (llm_engine.py drives the engine between the two).
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backend.config import EngineConfig
from backend.errors import INTERNAL_ERROR, UNAVAILABLE_ERRORS, EngineDeadError, ValidationError
from backend.sampling_params import SamplingParams
from serving.triton.device_map import check_nodes, instance_device, instance_gpu_ids, instance_placement

PATH_PARAMETERS = ("model", "tokenizer", "draft_model")  # relative to this model's directory
# request_options keys (preprocessing's RequestOptions): each a boolean
REQUEST_OPTIONS = (
    "stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
    "return_num_output_tokens", "return_logprobs", "return_cumulative_logprob", "null_logprobs", "in_band_errors",
    "return_output_log_probs", "return_batch_index",
)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE_FIELD_INPUTS = {"prompt_token_ids": "input_ids"}  # an engine error's field -> this model's input


def parameter_flag(name: str, value: str) -> bool:
    if value.strip().lower() not in ("true", "false"):
        raise ValidationError(name, f'must be "true" or "false", got {value!r}')
    return value.strip().lower() == "true"


def parameter_count(name: str, value: str) -> int:
    try:
        count = int(value.strip() or "0")
    except ValueError:
        count = -1
    if count < 0:
        raise ValidationError(name, f"must be an integer >= 0, got {value!r}")
    return count


def engine_parameters(model_config: dict, model_dir: Path) -> dict[str, str]:
    values = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    for key in PATH_PARAMETERS:
        value = values.get(key, "").strip()
        if value and not Path(value).is_absolute():
            values[key] = str(model_dir / value)
    return values


def engine_request(request) -> tuple[list[int], SamplingParams, dict, str]:
    """prompt ids, sampling params, request options and prompt text of a generation request, as
    preprocessing produced them; anything else is a ValidationError naming the input."""
    for name in ("input_ids", "sampling_params"):
        if pb_utils.get_input_tensor_by_name(request, name) is None:
            raise ValidationError(name, "required (or abort_request_id)")
    prompt_ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1).tolist()
    params = json_object(request, "sampling_params")
    if params is None:
        raise ValidationError("sampling_params", "must be a JSON object of sampling parameters")
    options = json_object(request, "request_options") or {}
    for key, value in options.items():
        if key not in REQUEST_OPTIONS or not isinstance(value, bool):
            raise ValidationError("request_options", f"must map some of {', '.join(REQUEST_OPTIONS)} to booleans")
    return prompt_ids, SamplingParams.from_dict(params), options, input_text(request, "prompt_text")


def json_object(request, name: str) -> dict | None:
    """A JSON object input (None when absent or blank)."""
    raw = input_text(request, name)
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValidationError(name, "malformed JSON") from None
    if not isinstance(value, dict):
        raise ValidationError(name, "must be a JSON object")
    return value


def format_traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def input_text(request, name: str) -> str:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return ""
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise ValidationError(name, f"must hold one string, got {value.size}")
    if not isinstance(value[0], bytes):
        return str(value[0])
    try:
        return value[0].decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError(name, "is not valid UTF-8") from None


def vllm_logprobs(entry: dict) -> dict:
    """An engine logprob entry in vllm_backend's shape: {token id: {"logprob", "rank",
    "decoded_token"}} for the chosen token (first) and the top n (ranked 1..n)."""
    chosen = entry["token_id"]
    out = {str(chosen): {"logprob": entry["logprob"], "rank": entry["rank"], "decoded_token": entry["text"][chosen]}}
    for rank, (token, lp) in enumerate(entry["top"].items(), start=1):
        if token != chosen:
            out[str(token)] = {"logprob": lp, "rank": rank, "decoded_token": entry["text"][token]}
    return out


def bytes_tensor(name: str, text: str):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


def uint32_tensor(name: str, value: int):
    return pb_utils.Tensor(name, np.array([value], dtype=np.uint32))


def refuse(sender, error: Exception) -> None:
    """End a request that was not taken: INVALID_ARG naming the field, UNAVAILABLE when the
    engine is dead, else INTERNAL_ERROR (the detail goes to the log)."""
    if isinstance(error, ValidationError):
        send_error(sender, str(error.renamed(ENGINE_FIELD_INPUTS)), pb_utils.TritonError.INVALID_ARG)
    elif isinstance(error, EngineDeadError):
        send_error(sender, str(error), pb_utils.TritonError.UNAVAILABLE)
    else:
        pb_utils.Logger.log_error(f"llm_engine: taking a request failed: {format_traceback(error)}")
        send_error(sender, INTERNAL_ERROR)


def final_error(options: dict, message: str):
    """The response that ends a request taken by the engine with an error: an error response
    (UNAVAILABLE when the engine or the server is going away, else INTERNAL), or, for a request
    with in_band_errors, a response with finish_reason "error" and the message as `error`."""
    if options.get("in_band_errors"):
        return pb_utils.InferenceResponse(
            output_tensors=[bytes_tensor("finish_reason", "error"), bytes_tensor("error", message)]
        )
    unavailable = message in UNAVAILABLE_ERRORS
    return error_response(message, pb_utils.TritonError.UNAVAILABLE if unavailable else None)


def error_response(message: str, code=None):
    code = pb_utils.TritonError.INTERNAL if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def send_error(sender, message: str, code=None) -> None:
    sender.send(error_response(message, code), flags=FINAL)


def engine_config(args: dict, model_config: dict) -> tuple[EngineConfig, bool, int]:
    """This instance's engine configuration from the model's parameters and its place in the
    instance group; whether the engine runs in a process of its own; max_pending_requests."""
    parameters = engine_parameters(model_config, Path(args["model_repository"]))
    engine_process = parameter_flag("engine_process", parameters.pop("engine_process", "false"))
    max_pending = parameter_count("max_pending_requests", parameters.pop("max_pending_requests", "0"))
    placement = instance_placement(args, model_config)
    gpu_device_ids = parameters.pop("gpu_device_ids", "")
    parameters["device"] = instance_device(
        placement, parameters.get("device", "auto"), gpu_device_ids,
        int(parameters.get("tensor_parallel_size", "1") or 1), torch.cuda.device_count(),
    )
    parameters["gpu_device_ids"] = instance_gpu_ids(placement, gpu_device_ids)  # a GPU per rank
    config = EngineConfig.from_strings(parameters)
    check_nodes(placement, config.nnodes)
    return config, engine_process, max_pending

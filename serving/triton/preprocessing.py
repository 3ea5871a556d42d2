"""preprocessing: text or chat messages -> input_ids, validated sampling params, request options.

The work itself is preprocessor.Preprocessor, which `llm_bls` runs in-process too; this model
serves it as the first step of the `llm` ensemble.

A request with `abort_request_id` is a stop request for the `llm` request sent with that id and
the same `abort_key` (serving/triton/abort_key.py): this model delivers the stop to every llm_engine
instance itself (serving/triton/abort_channel.py), at once, and passes the request on marked as delivered;
llm_engine answers it with an empty final response. A generation request's key is passed on.
tritonserver 2.51 never tells llm_engine that a client cancelled its `llm` request, so this is how
a client stops one.
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.errors import INTERNAL_ERROR, ValidationError
from serving.triton.abort_channel import ENGINE_MODEL, abort_everywhere
from serving.triton.abort_key import checked_abort_key, require_stop_key
from serving.triton import trtllm_inputs
from serving.triton.request_builder import Preprocessor, text_tensor
from serving.triton.request_inputs import scalar_text, triton_parameters
from serving.triton.startup_heap import freeze_startup_heap

# llm_engine's inputs for a stop request that this model has delivered already
DELIVERED_ABORT = {
    "input_ids": np.zeros(0, dtype=np.int32),
    "sampling_params": text_tensor(""),
    "request_options": text_tensor(json.dumps({"abort_delivered": True})),
    "prompt_text": text_tensor(""),
}


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        repository = Path(args["model_repository"]).parent  # args name the model's own directory
        self.preprocessor = Preprocessor.from_parameters(parameters, repository)
        # "tensorrt_llm": the inputs are TensorRT-LLM backend's (the `ensemble` model's first step)
        self.tensorrt_llm_inputs = parameters.get("input_convention", "llm") == "tensorrt_llm"
        self.input_names = [i["name"] for i in model_config["input"]]
        pb_utils.Logger.log_info(
            f"preprocessing: tokenizer {self.preprocessor.tokenizer_dir}, "
            f"max_model_len {self.preprocessor.max_model_len}"
        )
        freeze_startup_heap()

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._preprocess(request))
            except ValidationError as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
            except Exception as e:  # the detail goes to the log, never to the client
                pb_utils.Logger.log_error(
                    "preprocessing: " + "".join(traceback.format_exception(e))
                )
                error = pb_utils.TritonError(INTERNAL_ERROR, pb_utils.TritonError.INTERNAL)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses

    def _preprocess(self, request):
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        abort = inputs.pop("abort_request_id", None)
        abort_request_id = "" if abort is None else scalar_text("abort_request_id", abort)
        key = inputs.pop("abort_key", None)
        abort_key = checked_abort_key("" if key is None else scalar_text("abort_key", key))
        options = {}
        if self.tensorrt_llm_inputs:
            inputs, options = trtllm_inputs.llm_inputs(inputs)
        if abort_request_id:
            require_stop_key(abort_key)
            if not abort_everywhere(ENGINE_MODEL, abort_request_id, abort_key):
                pb_utils.Logger.log_error(f"preprocessing: no {ENGINE_MODEL} instance took the abort")
            engine_inputs = DELIVERED_ABORT | {"abort_request_id": text_tensor(abort_request_id),
                                               "abort_key": text_tensor(abort_key)}
        else:
            preprocessed = self.preprocessor(inputs, triton_parameters(request))
            for name, value in options.items():
                setattr(preprocessed.options, name, value)
            engine_inputs = preprocessed.engine_inputs() | {"abort_request_id": text_tensor(""),
                                                            "abort_key": text_tensor(abort_key)}
        outputs = [pb_utils.Tensor(n, a) for n, a in engine_inputs.items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

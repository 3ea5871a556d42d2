"""preprocessing: text or chat messages -> input_ids, validated sampling params, request options.

The work itself is preprocessor.Preprocessor, which `llm` runs in-process too; this model serves
it as the first step of the `ensemble` pipeline.
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.errors import INTERNAL_ERROR, ValidationError
from serving.preprocessor import Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        repository = Path(args["model_repository"]).parent  # args name the model's own directory
        self.preprocessor = Preprocessor.from_parameters(parameters, repository)
        self.input_names = [i["name"] for i in model_config["input"]]
        pb_utils.Logger.log_info(
            f"preprocessing: tokenizer {self.preprocessor.tokenizer_dir}, "
            f"max_model_len {self.preprocessor.max_model_len}"
        )

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
        preprocessed = self.preprocessor(inputs)
        outputs = [pb_utils.Tensor(n, a) for n, a in preprocessed.engine_inputs().items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

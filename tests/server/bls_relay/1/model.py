"""bls_relay: each request goes to llm_engine through decoupled BLS; every response comes back."""
import threading

import triton_python_backend_utils as pb_utils

INPUTS = ("input_ids", "sampling_params", "request_options")
OUTPUTS = ["text_output", "finish_reason", "error"]


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            inputs = [pb_utils.Tensor(name, pb_utils.get_input_tensor_by_name(request, name).as_numpy().copy())
                      for name in INPUTS]
            threading.Thread(target=_relay, args=(inputs, request.get_response_sender()), daemon=True).start()
        return None


def _relay(inputs, sender):
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    engine_request = pb_utils.InferenceRequest(model_name="llm_engine", inputs=inputs, requested_output_names=OUTPUTS)
    try:
        for response in engine_request.exec(decoupled=True):
            if response.has_error():
                sender.send(pb_utils.InferenceResponse(error=response.error()), flags=final)
                return
            tensors = response.output_tensors()
            if tensors:
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
    except Exception as e:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(repr(e))), flags=final)
        return
    sender.send(flags=final)

"""The python-backend models and what only they use.

    llm_engine.py       the decoupled `llm_engine` model around backend.EngineLoop, with
                        llm_engine_io.py (its parameters, a request's inputs, responses and errors),
                        request_state.py, sender_lane.py (one stuck receiver blocks no other),
                        engine_metrics.py, device_map.py (which device an instance runs on) and
                        admission_gate.py (back-pressure)
    llm_bls.py          the decoupled `llm_bls` model: preprocessing in-process, llm_engine over
                        engine_stream.py (a gRPC stream to the server's own endpoint)
    preprocessing.py    the `preprocessing` and `trtllm_preprocessing` models
    request_builder.py  text or chat messages -> token ids and validated parameters (the work of
                        preprocessing, shared with llm_bls), over request_inputs.py (Triton inputs
                        and parameters, read and checked) and trtllm_inputs.py (TensorRT-LLM names)
    abort_channel.py    cancellations from preprocessing and llm_bls to llm_engine (abort_key.py,
                        early_aborts.py), over a socket in runtime_directory.py
"""

"""Everything that knows Triton or tritonserver: the launcher, preprocessing, and the logic of the
python-backend models (`model_repository/*/1/model.py` import their TritonPythonModel from here).

    launcher.py        finds tritonserver (pip's nvidia-pytriton or an NGC image) and starts it
    preprocessing.py   the `preprocessing` model: preprocessor.py over request_inputs.py
    llm_engine.py      the decoupled `llm_engine` model around backend.EngineLoop, with
                       sender_lane.py (one stuck receiver blocks no other) and engine_metrics.py
    llm_bls.py         the decoupled `llm_bls` model: preprocessing in-process, llm_engine over
                       engine_stream.py (a gRPC stream to the server's own endpoint)
"""

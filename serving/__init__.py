"""Everything that knows Triton or tritonserver: the launcher, preprocessing, and the logic of the
python-backend models (`model_repository/*/1/model.py` import their TritonPythonModel from here).

    launcher.py        finds tritonserver (pip's nvidia-pytriton or an NGC image) and starts it
    preprocessing.py   the `preprocessing` model: preprocessor.py over request_inputs.py
    llm_engine.py      the decoupled `llm_engine` model around backend.EngineLoop, with
                       sender_lane.py (one stuck receiver blocks no other) and engine_metrics.py
    llm_bls.py         the decoupled `llm_bls` model: preprocessing in-process, llm_engine over BLS

The Python stub of tritonserver's python backend embeds an interpreter that ignores PYTHONPATH, so
importing this package puts PYTHONPATH's entries (the launcher sets them: this repository and the
environment's site-packages) on sys.path.
"""
from __future__ import annotations

import os
import sys

for _entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _entry and _entry not in sys.path:
        sys.path.insert(0, _entry)

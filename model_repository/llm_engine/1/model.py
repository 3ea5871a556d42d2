"""The `llm_engine` model; its logic is serving/triton/llm_engine.py."""
import os
import sys

# the stub's interpreter ignores PYTHONPATH, where the launcher puts this project and its environment
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
from serving.triton.llm_engine import TritonPythonModel  # noqa: E402,F401

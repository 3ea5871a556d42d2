"""The `preprocessing` model; its logic is serving/preprocessing.py (the stub's interpreter ignores PYTHONPATH,
so the repository holding this model repository goes on sys.path first)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from serving.preprocessing import TritonPythonModel  # noqa: E402,F401

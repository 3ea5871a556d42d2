"""The engine's log records (the `backend` and `specserve_kernels` loggers) in tritonserver's log,
through the python backend's Logger: what a model's start-up does (compiling steps, timing
kernels) shows where the operator reads the server's own lines."""
from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils

LOGGERS = ("backend", "specserve_kernels")


class TritonLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = f"{record.name}: {self.format(record)}"
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(message)
            else:
                pb_utils.Logger.log_info(message)
        except Exception:
            self.handleError(record)


def forward_engine_logs() -> None:
    """Send INFO and above of the engine's loggers to Triton's log (once per process)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
            logger.addHandler(TritonLogHandler())
            logger.setLevel(logging.INFO)

# specserve on GPUs: the NGC tritonserver image plus this repository.
# Not built in CI (CI has no Docker daemon with GPUs); see README "GPU deployment".
#   docker build -t specserve .
#   docker run --gpus all --shm-size 2g -p 8000-8002:8000-8002 specserve
ARG TRITON_VERSION=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

WORKDIR /opt/specserve
COPY pyproject.toml README.md ./
COPY backend backend
COPY client client
COPY kernels kernels
COPY serving serving
# torch from PyPI is a CUDA build, which is what this image wants
RUN pip install --no-cache-dir -e .
COPY model_repository model_repository

EXPOSE 8000 8001 8002 9000
# tritonserver is on PATH in this image, so the launcher uses it and its own Python backend
CMD ["python3", "-m", "serving.launcher", "--model-repository", "/opt/specserve/model_repository"]

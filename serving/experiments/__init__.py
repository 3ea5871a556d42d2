"""A/B experiments and rollouts between two model configurations (plain Python, no Triton).

    experiment.py   the arms, their weights and the user-sticky assignment
    request_log.py  every request's outcome per arm, persisted
    metrics.py      what the verdict compares and its configuration
    sequential.py   the always-valid (mixture SPRT) test
    verdict.py      the per-user verdict over the request log
    recorder.py     what the gateway records per request
    rollout.py      stepped rollouts with guardrails, holdout and persisted state
"""

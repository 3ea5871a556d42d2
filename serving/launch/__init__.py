"""Starting the server and keeping it healthy.

    launcher.py             finds tritonserver (pip's nvidia-pytriton or an NGC image) and starts it
                            on a model repository (`python -m serving.launch`)
    supervisor.py           a thread of the launcher: reloads llm_engine after its engine failed
    repository_variants.py  a model repository copied with other engine parameters (benchmarks, tests)
"""

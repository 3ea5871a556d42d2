"""Starting the server and keeping it healthy.

    launcher.py             starts tritonserver on a model repository, bound and with its admin key
    tritonserver_binary.py  finds tritonserver (pip's nvidia-pytriton or an NGC image)
    cli.py                  `python -m serving.launch` (specserve-serve): the server, the gateway
                            and the supervisor until Ctrl-C
    supervisor.py           a thread of the launcher: reloads llm_engine after its engine failed
    repository_variants.py  a model repository copied with other engine parameters (benchmarks, tests)
"""

"""The cache-aware router in front of prefill, decode and `both` workers, and a local cluster.

    server.py         Router: `python -m serving.router.server`
    client.py         RouterClient: picks a worker, retries, fails over
    policy.py         routing policies (affinity, round robin)
    workers.py        WorkerPool: the workers' health and load
    routed_engine.py  RoutedEngine: the engine interface over routed workers (HTTP front)
    http_front.py     the router's OpenAI-compatible HTTP front (a PagedJaxServer)
    cluster.py        workers + router as processes: `python -m serving.router.cluster`

May import: every other serving package (it sits on top), engine's public types.
"""

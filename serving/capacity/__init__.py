"""The shipped capacity tools, apart from the benchmarks' experiments: a load generator that
drives a running server and reports its capacity, and a planner that turns a measured
capacity into memory and replicas.

    loadgen/            `pagedjax-loadgen` / `python -m serving.capacity.loadgen` (its
                        __init__ maps it)
    planner.py          `pagedjax-planner`: KV memory feasibility and replicas for a demand
    planner_disagg.py   the planner's prefill/decode split (`pagedjax-planner disagg`)
    planner_host.py     the plan's host KV tier: prefix tokens that fit, expected hit rates

May import: configs, serving/proto/, serving/flags.py, serving/extras.py. A client of the
server, never the server: not engine, serving/frontend/, grpc_api/, http/, engine_host/,
router/ or disagg/.
"""

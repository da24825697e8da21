"""Transport-neutral request handling: admission, tenants, the engine thread, outcomes, metrics.

    deadlines.py       a request's deadline: header, SDK timeout, tenant or server default
    generation.py      Generator: admission order, refusals, outcomes (gRPC and HTTP share it)
    admission.py       where a request is admitted: limits, the bounded WaitingQueue
    tenants.py         x-api-key -> tenant; concurrency and tokens-per-minute budgets
    engine_loop.py     the engine thread; THE map of threads and queues (its docstring)
    request_state.py   per-request stream buffer, one-outcome ledger, JSON request log
    breaker.py         circuit breaker over engine steps
    capacity_model.py  the capacity model behind admission's estimates
    capacity_calibration.py  its measured error (margin) and its file beside the XLA cache
    prefix_shadow.py   the prompt share admission expects the prefix cache to serve
    metrics.py         Prometheus metrics in a per-server registry
    shutdown.py        graceful drain on SIGTERM

May import: engine (its public modules), configs, models, the grpc library (its StatusCode
is the outcome vocabulary). Never serving/grpc_api/, serving/http/ or serving/proto/.
"""

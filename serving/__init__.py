"""The serving layer: gRPC and OpenAI-compatible HTTP APIs, admission control, tenants,
metrics, client, mock engine.

    proto/pagedjax.proto   the API (stubs committed; proto/regen.sh regenerates them)
    server.py              PagedJaxServer: assembles everything; `python -m serving.server`
    generation.py          transport-neutral Generator: admission order, refusals, outcomes
    service.py             the gRPC handlers (GenerateCall from protobuf -> Generator)
    http_api.py            the OpenAI-compatible HTTP API (FastAPI): generation, SSE relay
    http_endpoints.py      its other endpoints: models, tokenize, health, ready, metrics
    http_schemas.py        its request schemas (pydantic, unknown fields refused)
    http_responses.py      its bodies, logprobs, usage, error object + statuses, identity
    http_server.py         uvicorn on its own thread in the same process
    engine_loop.py         the engine thread; THE map of threads and queues (its docstring)
    admission.py           limits, the bounded WaitingQueue (priority + aging), drain rate
    capacity_model.py      step times per batch size, prefill cost, the start-up probe
    capacity_calibration.py  the model's measured error (margin), its file beside the XLA cache
    tenants.py             x-api-key -> tenant; concurrency and tokens-per-minute budgets
    breaker.py             circuit breaker over engine steps
    request_state.py       per-request stream buffer, one-outcome ledger, JSON request log
    metrics.py             Prometheus metrics in a per-server registry
    convert.py             protobuf <-> engine types
    client.py              GenerateClient; `python -m serving.client`
    mock_engine.py         MockEngine: the real engine host code, a hand-checkable fake device
    testing.py             running_server(): a real server on an ephemeral port, for tests

One Generate call (an HTTP choice is the same with the event loop as its handler):
handler thread -> admission (reject at once, or WaitingQueue) -> engine
thread feeds the engine, steps it, pushes deltas to the request's StreamBuffer -> handler
thread streams them -> final message (finish reason, usage, timings, resolved versions) ->
exactly one recorded outcome and one JSON log line.
"""

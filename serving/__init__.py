"""The serving layer: gRPC and OpenAI-compatible HTTP APIs, admission control, tenants,
metrics, client, mock engine, router.

Top-level modules:
    server.py       PagedJaxServer: assembles everything; `python -m serving.server`
    ray_serve/      the same server as Ray Serve replicas (`serve run deploy/ray/serve.yaml`)
    cli.py          `pagedjax`: generate / chat / serve from one command line
    client.py       GenerateClient; `python -m serving.client`
    flags.py        one vocabulary of command-line flags for every command
    testing.py      running_server(): a real server on an ephemeral port, for tests
    extras.py       optional dependencies (pyproject extras) checked up front
    proto/          the API (pagedjax.proto, kv_transfer.proto; stubs committed, regen.sh)
Sub-packages (each __init__ maps its own folder):
    frontend/       transport-neutral: Generator, admission, tenants, engine thread, metrics
    grpc_api/       the gRPC service, its interceptors, protobuf <-> engine types
    http/           the OpenAI-compatible HTTP API (FastAPI + uvicorn)
    engine_host/    building the engine, in or out of process; the mock engine
    router/         the cache-aware router and the local cluster launcher
    disagg/         prefill/decode disaggregation: the KVTransfer service
    gateway/        Kubernetes inference gateways: vLLM metric names, llm-d KV events, P/D sidecar
    capacity/       the shipped capacity tools: load generator, planner (clients of a server)

One Generate call (an HTTP choice is the same with the event loop as its handler):
handler thread -> admission (reject at once, or WaitingQueue) -> engine
thread feeds the engine, steps it, pushes deltas to the request's StreamBuffer -> handler
thread streams them -> final message (finish reason, usage, timings, resolved versions) ->
exactly one recorded outcome and one JSON log line.
"""

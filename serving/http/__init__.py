"""The OpenAI-compatible HTTP API (FastAPI), served by uvicorn beside the gRPC server.

    api.py        HttpApi: generation, SSE relay
    endpoints.py  its other endpoints: models, tokenize, health, ready, metrics
    schemas.py    its request schemas (pydantic, unknown fields refused)
    responses.py  its bodies, logprobs, usage, error object + statuses, identity
    lora.py       adapter load/unload endpoints
    chat.py       a chat request's tools and messages in engine/chat's terms
    responses_api.py  POST /v1/responses, a translation onto the chat path
    delivery.py   delivery accounting of streamed chunks
    server.py     uvicorn on its own thread in the same process

May import: engine, serving/frontend/, serving/grpc_api/convert.py. Never the gRPC
service (serving/grpc_api/service.py).
"""

"""Kubernetes inference gateways (llm-d, the Gateway API Inference Extension, KServe): what a
gateway's endpoint picker and routing sidecar read from and send to a model server.

    metrics_compat.py       vLLM's model-server protocol metric names, aliases of ours
    kv_events_publisher.py  KV-cache events in llm-d's format on a ZMQ PUB socket
    http_kv_transfer.py     `kv_transfer_params` for llm-d's prefill/decode sidecar

May import: engine (public modules), configs, serving.frontend, serving.disagg, serving.proto
and serving.client (the sidecar pulls K/V over gRPC). Never
serving.http (which calls into this package) or serving.grpc_api.
"""

"""Prefill/decode disaggregation: the KVTransfer gRPC service and its two transports.

    service.py       worker roles (prefill, decode, both): the KVTransfer service
    wire.py          K/V as chunked gRPC bytes
    jax_transfer.py  K/V over jax.experimental.transfer (device to device)

May import: engine (engine/kv_transfer/ included), serving/proto/, serving/frontend/.
"""

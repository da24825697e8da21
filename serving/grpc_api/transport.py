"""gRPC transport settings of the server: the port is exclusive, and message sizes bounded.

NOTE: gRPC sets SO_REUSEPORT by default, so a second server on a taken port would start and
the kernel would split connections between the two; `grpc.so_reuseport=0` makes the bind
fail, and `bind_port` turns that into PortInUseError naming the address.
"""

from __future__ import annotations

__all__ = ["PortInUseError", "bind_port", "grpc_options"]


class PortInUseError(OSError):
    """The gRPC port could not be bound (another process holds it)."""


def grpc_options(max_request_bytes: int) -> list[tuple[str, int]]:
    # gRPC core refuses messages past twice our limit; between the two, serving/grpc_api/guard.py
    # answers with a clearer INVALID_ARGUMENT.
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", 2 * max_request_bytes),
    ]


def bind_port(grpc_server, host: str, port: int) -> int:
    address = f"{host}:{port}"
    try:
        bound = grpc_server.add_insecure_port(address)
    except RuntimeError as e:  # recent grpcio raises; older ones return 0
        raise PortInUseError(f"cannot bind gRPC port {address}: already in use? ({e})") from e
    if bound == 0:
        raise PortInUseError(f"cannot bind gRPC port {address}: already in use?")
    return bound

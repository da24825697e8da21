"""uvicorn serving the HTTP API on its own thread (its own asyncio loop) inside the gRPC
server's process. The socket is bound before the thread starts, so port 0 gives an ephemeral
port that `.port` reports at once."""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

log = logging.getLogger("pagedjax.serving")


def _bind(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, app, host: str, port: int, graceful_shutdown_s: float = 1.0):
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=max(graceful_shutdown_s, 0.01),
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="http", daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"HTTP server failed to start on port {self.port}")
            time.sleep(0.005)
        log.info("HTTP server started on port %d", self.port)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

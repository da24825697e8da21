"""The router's client of its workers: route one Generate, relay its messages, retry once.

Transport-neutral, so the router's gRPC front (serving/router/server.py: RouterService) and its
HTTP front (serving/router/routed_engine.py under the server's HTTP API) share it:

    RouterClient.generate(req, deadline_s, metadata, on_call, is_active)   a generator
      pick(req)   prefill + decode workers routable?  -> pair: prefill = bounded-load ring
                                                        pick by prefix key, decode = least
                                                        loaded; KVTransfer.Decode on decode
                  else `both` replicas routable?      -> ring pick; PagedJax.Generate
                  else                                -> NoRoute
      relay       yields the worker's GenerateResponse messages unchanged; returns its
                  trailing metadata (the x-pagedjax-kv-* transfer figures)
      retry       UNAVAILABLE before the first message (the worker died, warms up, drains):
                  the worker it blames (the prefill worker when the decode worker's pull
                  failed, else the called one) is marked down and the request goes once to
                  a route without it (never a duplicate stream: nothing was relayed); after
                  the first message, or on the second attempt, RouteFailed(UNAVAILABLE)
      cancel      `on_call(call)` gets each worker call as it starts: the caller cancels it
                  when its own client leaves (the decode worker then cancels its pull, so
                  pages are freed on every worker); `is_active()` False marks a failure that
                  followed such a cancel (RouteFailed(CANCELLED), nothing marked down)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc

from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import pagedjax_pb2 as pb
from serving.router.policy import HashRing, RoundRobin, pick_bounded, prefix_key
from serving.router.workers import WorkerPool

POLICIES = ("affinity", "round_robin")


class NoRoute(Exception):
    """No prefill + decode pair and no `both` replica is routable now."""


class RouteFailed(Exception):
    """A routed call ended with a gRPC status other than OK (code, details, trailing)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        self.code, self.details, self.trailing = code, details, trailing
        super().__init__(f"{code.name}: {details}")


class _Retry(Exception):
    """An attempt failed before any message; `exclude`: the workers not to try again."""

    def __init__(self, exclude: tuple[str, ...]):
        self.exclude = exclude


class Route:
    """One attempt: a `both` replica, or a (prefill, decode) pair."""

    def __init__(self, kind: str, prefill: str, decode: str = ""):
        self.kind, self.prefill, self.decode = kind, prefill, decode

    @property
    def addresses(self) -> tuple[str, ...]:
        return (self.prefill, self.decode) if self.decode else (self.prefill,)


class RouterClient:
    def __init__(self, pool: WorkerPool, policy: str = "affinity", load_factor: float = 1.25):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: one of {POLICIES}")
        self.pool, self.policy, self.load_factor = pool, policy, load_factor
        self._rr = RoundRobin()
        self._lock = threading.Lock()
        self.counters = {"routed_pair": 0, "routed_both": 0, "spilled": 0, "retried": 0}

    # ---- routing ------------------------------------------------------------------------------
    def pick(self, request: pb.GenerateRequest, exclude: tuple[str, ...] = ()) -> Route:
        def usable(a: str) -> bool:
            return a not in exclude and self.pool.is_routable(a)

        prefill = [a for a in self.pool.routable("prefill") if usable(a)]
        decode = [a for a in self.pool.routable("decode") if usable(a)]
        if prefill and decode:
            first = self._choose(prefill, request, usable)
            second = min(decode, key=self.pool.load)
            self._count("routed_pair")
            return Route("pair", first, second)
        both = [a for a in self.pool.routable("both") if usable(a)]
        if both:
            self._count("routed_both")
            return Route("both", self._choose(both, request, usable))
        raise NoRoute("no routable worker (need a prefill + decode pair or a `both` replica)")

    def has_route(self) -> bool:
        """A pair or a replica is routable now (the router's own health)."""
        pool = self.pool
        return bool(pool.routable("prefill") and pool.routable("decode")) or bool(
            pool.routable("both")
        )

    def _choose(self, members: list[str], request, usable) -> str:
        if self.policy == "round_robin":
            return self._rr.pick(sorted(members), usable)
        chosen, spilled = pick_bounded(
            HashRing(sorted(members)), prefix_key(request), self.pool.load, usable, self.load_factor
        )
        if spilled:
            self._count("spilled")
        return chosen

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    # ---- one call ---------------------------------------------------------------------------
    def generate(
        self,
        req: pb.GenerateRequest,
        *,
        deadline_s: float | None = None,
        metadata: tuple | None = None,
        on_call: Callable[[grpc.Future], None] = lambda call: None,
        is_active: Callable[[], bool] = lambda: True,
    ) -> Iterator[pb.GenerateResponse]:
        """Yields the worker's messages; returns its trailing metadata. Raises NoRoute or
        RouteFailed. `deadline_s`: time.monotonic() absolute (None: no deadline)."""
        tried: tuple[str, ...] = ()
        for attempt in range(2):
            route = self.pick(req, exclude=tried)
            try:
                return (
                    yield from self._relay(
                        route, req, deadline_s, metadata, on_call, is_active, attempt == 0
                    )
                )
            except _Retry as retry:
                tried += retry.exclude
                self._count("retried")
        raise AssertionError("unreachable: the second attempt is not retryable")

    def _relay(self, route, req, deadline_s, metadata, on_call, is_active, retryable: bool):
        """One attempt: trailing metadata when it ended OK; raises _Retry when it failed
        before any message and may be retried elsewhere, RouteFailed otherwise."""
        if not self.pool.acquire(*route.addresses):  # a worker left the pool since pick()
            if retryable:
                raise _Retry(route.addresses)
            raise RouteFailed(grpc.StatusCode.UNAVAILABLE, f"workers {route.addresses} left")
        try:
            call = self._start(route, req, deadline_s, metadata)
            on_call(call)
            sent = False
            try:
                for msg in call:
                    sent = True
                    yield msg
                return tuple(call.trailing_metadata() or ())
            except GeneratorExit:  # the caller stopped reading: end the worker call too
                call.cancel()
                raise
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or e.code().name
                if not is_active():
                    raise RouteFailed(grpc.StatusCode.CANCELLED, "cancelled by the client") from e
                if code == grpc.StatusCode.UNAVAILABLE:
                    failed = self._mark_failed(route, details)
                    if retryable and not sent:
                        raise _Retry((failed,)) from e
                raise RouteFailed(code, details, tuple(e.trailing_metadata() or ())) from e
        finally:
            self.pool.release(*route.addresses)

    def _start(self, route: Route, req, deadline_s, metadata):
        timeout = None if deadline_s is None else max(0.0, deadline_s - time.monotonic())
        if route.kind == "both":
            stub = self.pool.workers[route.prefill].generate
            return stub.Generate(req, timeout=timeout, metadata=metadata)
        return self.pool.workers[route.decode].kv.Decode(
            kv_pb.DecodeRequest(request=req, kv_source=route.prefill),
            timeout=timeout,
            metadata=metadata,
        )

    def _mark_failed(self, route: Route, details: str) -> str:
        """Mark the worker a call's UNAVAILABLE blames down (the decode worker names a dead
        prefill worker in its details); returns its address."""
        if route.kind == "pair" and details.startswith("prefill worker"):
            failed = route.prefill
        else:
            failed = route.decode or route.prefill
        self.pool.mark_down(failed)
        return failed

"""RoutedEngine: the Engine Protocol (engine/interface.py) over the router's workers, so the
router serves the server's OpenAI-compatible HTTP API (serving/http/api.py) unchanged.

    HTTP client -> HttpApi -> Generator (admission: tenants, limits, queue, breaker, ledger)
      -> EngineLoop (the one engine thread) -> RoutedEngine.add_request(EngineRequest)
           -> one relay thread per request: EngineRequest -> GenerateRequest (token ids,
              every sampling field the gRPC API carries) -> RouterClient.generate (pick a
              pair or a replica, retry once before the first message) -> each worker
              message becomes a RequestOutput delta in the outbox
      <- RoutedEngine.step(): the outbox's deltas (waits up to `step_wait_s` for one)
      <- EngineLoop routes them to the request's StreamBuffer -> SSE / JSON, as on a worker

The router tokenizes (its `--tokenizer` must hash like the workers' tokenizer; checked at
start-up, serving/router/server.py), the workers detokenize and apply stop strings, so text deltas
are relayed as the worker produced them. A disconnect or cancel reaches `abort_request`,
which cancels the worker call: the decode worker cancels its pull and every worker frees
the request's pages. A worker call that ends with a gRPC status becomes a final delta:
DEADLINE_EXCEEDED -> timed_out, CANCELLED -> cancelled, RESOURCE_EXHAUSTED -> rejected,
UNAVAILABLE / no route -> "unavailable" (HTTP 503), anything else -> failed (HTTP 500).

LoRA: the HTTP `model` may name an adapter loaded on EVERY routable worker with the same
content hash (their WorkerInfo reports name -> hash; `adapters.loaded` here is that
intersection, so the server's resolve_adapter and /v1/models see them); it crosses as the
gRPC `adapter` field. Routing ignores adapters (any routable worker has it); an adapter
unloaded between the check and the call is the worker's NOT_FOUND. Loading adapters through
the router (/v1/load_lora_adapter) is not supported: load them on the workers.
include_stop_str_in_output and skip_special_tokens cross as GenerateRequest fields.
Token times are the workers' (unix ns on the wire, mapped to this process's monotonic clock).
Sampling floats cross the gRPC API as float32 (top_p=0.9 arrives as 0.89999998), as they do
for any gRPC client.
"""

from __future__ import annotations

import threading

import grpc

from engine.api_types import (
    AdapterRef,
    EngineRequest,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from serving.grpc_api.convert import UNIX_MINUS_MONOTONIC_NS
from serving.proto import SAMPLING_FIELDS
from serving.proto import pagedjax_pb2 as pb
from serving.router.client import NoRoute, RouteFailed, RouterClient

PB_PRIORITY = {0: pb.PRIORITY_LOW, 1: pb.PRIORITY_NORMAL, 2: pb.PRIORITY_HIGH}
FINISH_OF_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "timed_out",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
    grpc.StatusCode.UNAVAILABLE: "unavailable",  # serving/frontend/engine_loop.py: 503
}


def generate_request(er: EngineRequest) -> pb.GenerateRequest:
    """`er` as the gRPC API says it."""
    sp = er.sampling
    req = pb.GenerateRequest(
        request_id=er.request_id,
        token_ids=pb.TokenIds(ids=er.prompt_token_ids),
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        ignore_eos=sp.ignore_eos,
        priority=PB_PRIORITY.get(er.priority, pb.PRIORITY_NORMAL),
        stream=True,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        adapter=er.adapter or "",
    )
    if not sp.skip_special_tokens:
        req.skip_special_tokens = False
    for name in SAMPLING_FIELDS:
        value = getattr(sp, name)
        if value is not None:
            setattr(req.sampling, name, value)
    s = sp.structured
    if s is not None:
        if s.choice is not None:
            req.choice.choices.extend(s.choice)
        elif s.json_object:
            req.json_object = True
        else:
            kind = next(k for k in ("json_schema", "regex", "grammar") if getattr(s, k))
            setattr(req, kind, getattr(s, kind))
    return req


def _monotonic_s(unix_ns: int) -> float:
    return (unix_ns - UNIX_MINUS_MONOTONIC_NS) / 1e9


class _Relay:
    """One request's worker call, as its relay thread and the engine thread share it."""

    def __init__(self, er: EngineRequest):
        self.er = er
        self.call = None
        self.cancelled = False
        self.finished = False  # the worker's final message was relayed
        self.num_output_tokens = 0
        self.lock = threading.Lock()

    def set_call(self, call) -> None:
        with self.lock:
            self.call = call
            cancel = self.cancelled
        if cancel:
            call.cancel()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled, call = True, self.call
        if call is not None:
            call.cancel()


class ClusterAdapters:
    """`loaded` as engine/lora/refs.loaded_adapters reads it: the LoRA adapters every
    routable worker has loaded, with one content hash."""

    def __init__(self, pool):
        self.pool = pool

    @property
    def loaded(self) -> dict[str, AdapterRef]:
        pool = self.pool
        addresses = [a for role in ("both", "prefill", "decode") for a in pool.routable(role)]
        if not addresses:
            return {}
        maps = [pool.workers[a].adapters for a in addresses]
        return {
            name: AdapterRef(name, content_hash, path="", rank=0, slot=0)
            for name, content_hash in maps[0].items()
            if all(m.get(name) == content_hash for m in maps[1:])
        }


class RoutedEngine:
    def __init__(
        self,
        client: RouterClient,
        tokenizer,
        identity,
        stats: dict,
        *,
        metadata: tuple | None = None,
        step_wait_s: float = 0.01,
    ):
        """`identity`: the cluster's (models.identity.ModelIdentity); `stats`: what the
        server sizes admission from (max_model_len, max_num_seqs)."""
        self.client, self.tokenizer, self.identity = client, tokenizer, identity
        self.metadata, self.step_wait_s = metadata, step_wait_s
        self._stats = dict(stats)
        self._relays: dict[str, _Relay] = {}  # engine thread only
        self._outbox: list[RequestOutput] = []
        self._cond = threading.Condition()

    # ---- the Engine Protocol (engine thread) ---------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        req = generate_request(er)
        relay = _Relay(er)
        self._relays[er.request_id] = relay
        threading.Thread(
            target=self._run, args=(relay, req), name=f"route-{er.request_id}", daemon=True
        ).start()

    def abort_request(self, request_id: str) -> None:
        relay = self._relays.get(request_id)
        if relay is not None:
            relay.cancel()  # the relay thread then emits the final "cancelled" delta

    def has_unfinished(self) -> bool:
        return bool(self._relays)

    def step(self) -> list[RequestOutput]:
        with self._cond:
            if not self._outbox:
                self._cond.wait(self.step_wait_s)
            outputs, self._outbox = self._outbox, []
        for out in outputs:
            if out.finished:
                self._relays.pop(out.request_id, None)
        return outputs

    @property
    def adapters(self) -> ClusterAdapters:
        return ClusterAdapters(self.client.pool)

    def not_ready_reason(self) -> str | None:
        """The HTTP /ready answer's reason (serving/http/endpoints.py): "no_route" while no
        prefill + decode pair and no `both` replica is routable, as the router's gRPC health."""
        return None if self.client.has_route() else "no_route"

    def stats(self) -> dict:
        return {**self._stats, "num_running": len(self._relays), **self.client.counters}

    # ---- relay threads ------------------------------------------------------------------------
    def _emit(self, out: RequestOutput) -> None:
        with self._cond:
            self._outbox.append(out)
            self._cond.notify()

    def _run(self, relay: _Relay, req: pb.GenerateRequest) -> None:
        er = relay.er
        try:
            stream = self.client.generate(
                req,
                deadline_s=er.deadline_s,
                metadata=self.metadata,
                on_call=relay.set_call,
                is_active=lambda: not relay.cancelled,
            )
            # NOTE: read to the end of the call (not just to the final message): leaving
            # it early would cancel a call the worker has not yet closed as a success
            for msg in stream:
                relay.finished |= msg.HasField("final")
                self._emit(self._delta(relay, msg))
            error = ("failed", "the worker's stream ended without a final message")
        except NoRoute as e:
            error = ("unavailable", str(e))
        except RouteFailed as e:
            error = (FINISH_OF_STATUS.get(e.code, "failed"), f"worker: {e}")
        except Exception as e:  # noqa: BLE001 - a bug must still end the request
            error = ("failed", f"router relay: {e!r}")
        if relay.finished:
            return  # its final delta is out (a late error changes nothing)
        if relay.cancelled:
            error = ("cancelled", "cancelled")
        self._emit(self._final_error(relay, *error))

    def _delta(self, relay: _Relay, msg: pb.GenerateResponse) -> RequestOutput:
        relay.num_output_tokens += len(msg.token_ids)
        out = RequestOutput(
            relay.er.request_id,
            list(msg.token_ids),
            msg.text,
            [_monotonic_s(t) for t in msg.token_times_unix_ns],
            num_prompt_tokens=len(relay.er.prompt_token_ids),
            num_output_tokens=relay.num_output_tokens,
            logprobs=[
                TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                for lp in msg.logprobs
            ]
            or None,
        )
        if msg.HasField("final"):
            f = msg.final
            out.finished, out.finish_reason = True, f.finish_reason
            out.num_cached_tokens = f.usage.cached_tokens
            out.metrics = RequestMetrics(
                queue_s=f.timings.queue_s,
                ttft_s=f.timings.ttft_s,
                tpot_s=f.timings.tpot_s or None,
                e2e_s=f.timings.e2e_s,
                cached_tokens=f.usage.cached_tokens,
            )
        return out

    def _final_error(self, relay: _Relay, finish_reason: str, error: str) -> RequestOutput:
        return RequestOutput(
            relay.er.request_id,
            [],
            "",
            [],
            finished=True,
            finish_reason=finish_reason,
            num_prompt_tokens=len(relay.er.prompt_token_ids),
            num_output_tokens=relay.num_output_tokens,
            error=error,
            metrics=RequestMetrics(),
        )

    def close(self) -> None:
        """Cancel every worker call (the server stops)."""
        for relay in list(self._relays.values()):
            relay.cancel()

"""The engine in a child process of its own (issue 17, item 2), as vLLM v1 runs its EngineCore.

Why: the engine's host work per step (scheduler, batch build, dispatch, detokenizer, stop
checks) is Python holding the interpreter lock; in the server's process it competes with the
gRPC and HTTP handler threads for that one lock, so a refusal that takes 0.1 ms of work
reached a second client after up to ~100 ms while SmolLM2 stepped, and in a burst the 300
handler threads' parsing and tokenizing starved the engine thread (its admitted requests
then missed their deadlines). In a process of its own the engine has its own interpreter
lock and the OS shares the cores between the two processes.

    serving process                                     engine process (_serve)
      handler threads: admit, stream, account             builds the engine from
      EngineLoop thread (serving/frontend/engine_loop.py)           (model, options), sends its
        drives a ProcessEngine exactly like an             identity, tokenizer and stats,
        in-process engine (engine/interface.py) ---------> then answers one command at a
                          one Pipe, pickled tuples <------ time, in order

    parent -> child                          child -> parent
    ("add", EngineRequest)                   ("ok", None) | ("invalid", field, value, limit)
    ("abort", request_id)                    nothing (applied in order before the next step)
    ("step",)                                ("ok", (outputs, has_unfinished, last_step_info))
                                             | ("step_error", message, request_ids | None)
    ("stats",)                               ("ok", dict)
    ("warmup", max_shapes, execute)          ("ok", None)
    ("call", method, args)                   ("ok", result)   (test hooks, e.g. fail_next_steps)
    ("close",)                               the child exits

The protocol is lockstep (one command, its reply), so EngineLoop's bookkeeping, and with it
exactly one outcome per request, is the same as in-process: only where the engine's work
runs changes. The parent's engine thread waits for a step's reply in `Connection.poll`,
which releases the interpreter lock for the handler threads.

Lifecycle and faults:
- start: `ProcessEngine.start(model, options)` returns once the child has built the engine
  (or raises EngineProcessError with the child's error); warm-up runs later through
  `warmup()` (the server calls it on its engine thread, refusing calls as warming_up).
- the child ignores SIGINT/SIGTERM (the server drains on them, then closes the engine) and
  exits when the pipe closes, so it never outlives its server.
- a child that dies, or does not answer within `reply_timeout_s` (then killed), loses the
  requests it held (the parent keeps their ids: added, not yet finished). The next step()
  raises EngineProcessDied naming them, so EngineLoop._fail_step fails exactly those
  (INTERNAL, one outcome each; the breaker counts it); the next call that needs a child
  starts a fresh one (model built again, and warmed if it was), so serving resumes. add and
  stats retry once on the fresh child.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import logging
import multiprocessing
import signal
import threading
from multiprocessing.connection import Connection

from engine.api_types import EngineRequest, RequestOutput
from engine.errors import EngineStepError, InvalidRequestError, PagedJaxError

log = logging.getLogger("pagedjax.serving")


class EngineProcessError(PagedJaxError):
    """The engine process could not be started (its error is in the message)."""


class EngineProcessDied(EngineStepError):
    """The engine process died or stopped answering; `request_ids` are the requests it held
    (EngineLoop._fail_step fails exactly those)."""

    def __init__(self, message: str, request_ids: list[str] | None = None):
        super().__init__(message)
        self.request_ids = request_ids


class ChildStepError(EngineStepError):
    """A step raised in the engine process; `request_ids` as the engine named them."""

    def __init__(self, message: str, request_ids: list[str] | None):
        super().__init__(message)
        self.request_ids = request_ids


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the child builds:
    serving.engine_host.build.build_engine(model, options, **build_kwargs)."""

    model: str
    options: dict
    build_kwargs: dict = dataclasses.field(default_factory=dict)
    compilation_cache_dir: str | None = None  # as --compilation_cache_dir (None: default)


class ProcessEngine:
    """Implements engine.interface.Engine by forwarding to an engine in a child process.
    Called from one thread (the engine thread); a lock guards the pipe anyway."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        start_timeout_s: float = 1800.0,
        reply_timeout_s: float = 600.0,
    ):
        self.spec = spec
        self.start_timeout_s, self.reply_timeout_s = start_timeout_s, reply_timeout_s
        self.identity = None
        self.tokenizer = None
        self.initial_stats: dict = {}
        self.num_restarts = 0
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._has_unfinished = False
        self.last_step_info: dict | None = None  # the child engine's last step (tracing, MoE)
        self._held: set[str] = set()  # added to the current child, not finished yet
        self._lost: set[str] = set()  # held by a child that died, not yet reported by step()
        self._death = ""  # why the last child died
        self._warm_shapes: int | None = None  # warm-up to repeat after a restart
        self._warm_execute = False
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def start(cls, model: str, options: dict, **kwargs) -> ProcessEngine:
        build_kwargs = kwargs.pop("build_kwargs", {})
        cache_dir = kwargs.pop("compilation_cache_dir", None)
        engine = cls(EngineSpec(model, dict(options), build_kwargs, cache_dir), **kwargs)
        engine._spawn()
        return engine

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    # ---- engine.interface.Engine ------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        reply = self._call_retrying(("add", request))
        if reply[0] == "invalid":
            raise InvalidRequestError(*reply[1:])
        self._held.add(request.request_id)
        self._has_unfinished = True

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            if self._conn is None or not self.alive:
                return  # nothing to abort in a dead child (its requests are failed)
            # a send failing here is noticed by the next call that waits for a reply
            with contextlib.suppress(OSError, EOFError):
                self._conn.send(("abort", request_id))

    def step(self) -> list[RequestOutput]:
        """Reports a dead child's requests first (raises EngineProcessDied naming them)."""
        with self._lock:
            if self._conn is not None and not self.alive:
                self._lose(f"exit code {self._proc.exitcode}")
        if not self._lost:
            try:
                reply = self._call(("step",))
            except EngineProcessDied:
                pass  # its requests are in _lost now
            else:
                if reply[0] == "step_error":
                    self._held.difference_update(reply[2] or ())
                    raise ChildStepError(reply[1], reply[2])
                outputs, self._has_unfinished, self.last_step_info = reply[1]
                self._held.difference_update(o.request_id for o in outputs if o.finished)
                return outputs
        lost, self._lost = sorted(self._lost), set()
        raise EngineProcessDied(f"engine process died ({self._death})", lost)

    def has_unfinished(self) -> bool:
        return self._has_unfinished or bool(self._lost)

    def stats(self) -> dict:
        return self._call_retrying(("stats",))[1]

    # ---- the rest ---------------------------------------------------------------------------
    def warmup(self, max_shapes: int, execute: bool = False) -> None:
        """Compile the engine's step shapes in the child (serving.engine_host.build.engine_warmup);
        `execute`: and run each once."""
        self._warm_shapes, self._warm_execute = max_shapes, execute
        # NOTE: no reply timeout: 90-120 SmolLM2 step programs took over 30 min on this
        # loaded CPU; a child that dies meanwhile still ends the wait (EOF).
        self._call(("warmup", max_shapes, execute), timeout_s=None)

    def call(self, method: str, *args):
        """Call a method of the child's engine (test hooks such as fail_next_steps)."""
        return self._call(("call", method, args))[1]

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to exit (kill it after `timeout_s`). A call in flight on another
        thread (a long warm-up or step) is not waited for: the child is killed and that
        call raises EngineProcessDied."""
        self._closed = True  # no restart after this
        if not self._lock.acquire(timeout=1.0):
            proc = self._proc
            if proc is not None:
                proc.kill()  # the caller holding the lock then sees EOF
                proc.join(timeout_s)
            return
        try:
            conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        finally:
            self._lock.release()
        if conn is not None:
            with contextlib.suppress(OSError, EOFError):
                conn.send(("close",))
            conn.close()
        if proc is not None:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)

    def __del__(self):
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.is_alive():
            proc.kill()

    # ---- the pipe ---------------------------------------------------------------------------
    def _call_retrying(self, message: tuple) -> tuple:
        """Once more on a fresh child if the child died (what it held is failed by step())."""
        try:
            return self._call(message)
        except EngineProcessDied:
            return self._call(message)

    def _call(self, message: tuple, timeout_s: float | None = -1.0) -> tuple:
        """One command and its reply; `timeout_s` -1: reply_timeout_s, None: no limit."""
        timeout_s = self.reply_timeout_s if timeout_s == -1.0 else timeout_s
        with self._lock:
            if self._conn is not None and not self.alive:
                self._lose(f"exit code {self._proc.exitcode}")
            if self._conn is None:
                if self._closed:
                    raise EngineProcessError("the engine process was closed")
                self._restart()
            try:
                self._conn.send(message)
                reply = self._recv(timeout_s)
            except (OSError, EOFError, TimeoutError) as e:
                self._lose(f"{e!r} during {message[0]}")
                raise EngineProcessDied(f"engine process died ({self._death})") from e
        if reply[0] == "fatal":
            raise EngineProcessError(f"engine process failed on {message[0]}: {reply[1]}")
        return reply

    def _recv(self, timeout_s: float | None) -> tuple:
        # NOTE: poll() waits without the interpreter lock; a dead child makes it return
        # (recv then raises EOFError), so the timeout only catches a hung one.
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"no reply within {timeout_s}s")
        return self._conn.recv()

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.spec), name="engine", daemon=True)
        proc.start()
        child.close()
        self._conn, self._proc = parent, proc
        try:
            reply = self._recv(self.start_timeout_s)
        except (OSError, EOFError, TimeoutError) as e:
            self._kill()
            raise EngineProcessError(f"engine process did not start: {e!r}") from e
        if reply[0] != "ready":
            self._kill()
            raise EngineProcessError(f"engine process failed to build the engine: {reply[1]}")
        _, self.identity, self.tokenizer, self.initial_stats = reply
        self._has_unfinished = False
        log.info("engine process %d serving %s", proc.pid, self.identity)

    def _lose(self, why: str) -> None:
        """The child died (called with the lock held): what it held is lost."""
        log.error("engine process %s died: %s", self.pid, why)
        self._death = why
        self._kill()
        self._lost |= self._held
        self._held = set()
        self._has_unfinished = False

    def _restart(self) -> None:
        """A fresh child after a crash (called with the lock held)."""
        self.num_restarts += 1
        log.warning("starting engine process again (restart %d)", self.num_restarts)
        self._spawn()
        if self._warm_shapes:
            try:
                self._conn.send(("warmup", self._warm_shapes, self._warm_execute))
                self._recv(None)
            except (OSError, EOFError) as e:
                self._kill()
                msg = f"restarted engine process died warming up: {e!r}"
                raise EngineProcessError(msg) from e

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._conn, self._proc = None, None


# ---- the child ----------------------------------------------------------------------------
def _reduce_chat_template(template):
    return type(template), (template.text, template.source)


def _serve(conn: Connection, spec: EngineSpec) -> None:
    """The engine process: build, say ready, then answer commands until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains, then closes the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from serving.engine_host.build import build_engine, engine_warmup

    try:
        if spec.model != "mock":  # JAX's persistent cache is per process: set it up here
            from engine.runner.compilation_cache import enable

            enable(spec.compilation_cache_dir)
        engine = build_engine(spec.model, dict(spec.options), **spec.build_kwargs)
        tokenizer = engine.tokenizer
        _register_tokenizer_pickling(tokenizer)
        conn.send(("ready", engine.identity, tokenizer, dict(engine.stats())))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("fatal", repr(e)))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        if message[0] == "close":
            return
        reply = _handle(engine, message, engine_warmup)
        if reply is not None:
            conn.send(reply)


def _handle(engine, message: tuple, engine_warmup) -> tuple | None:
    kind = message[0]
    try:
        if kind == "add":
            engine.add_request(message[1])
            return ("ok", None)
        if kind == "abort":
            engine.abort_request(message[1])
            return None
        if kind == "step":
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - the parent fails that step's requests
                return ("step_error", str(e), getattr(e, "request_ids", None))
            info = getattr(engine, "last_step_info", None)
            return ("ok", (outputs, engine.has_unfinished(), info))
        if kind == "stats":
            return ("ok", dict(engine.stats()))
        if kind == "warmup":
            run = engine_warmup(engine, message[1], execute=message[2])
            if run is not None:
                run()
            return ("ok", None)
        if kind == "call":
            return ("ok", getattr(engine, message[1])(*message[2]))
    except InvalidRequestError as e:
        return ("invalid", e.field, e.value, e.limit)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        log.exception("engine process: %s failed", kind)
        return ("fatal", repr(e))
    return ("fatal", f"unknown command {kind!r}")


def _register_tokenizer_pickling(tokenizer) -> None:
    """A compiled Jinja chat template does not pickle; rebuild it from its text."""
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and hasattr(template, "text"):
        copyreg.pickle(type(template), _reduce_chat_template)

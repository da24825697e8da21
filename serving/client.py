"""gRPC client for the pagedjax server.

    pagedjax-client --target=127.0.0.1:50051 --prompt="Hello"          # generate (chat)
    pagedjax-client tokenize --prompt="Hello" | models | info            # JSON replies
    (or: python -m serving.client ...; --raw sends the prompt text without the chat template)

Importable: `GenerateClient` (used by the load generator).

    with GenerateClient("localhost:50051", api_key=None) as c:
        res = c.generate("Hello", max_tokens=32, temperature=0.0, timeout_s=10)
        res.ok, res.code, res.text, res.finish_reason, res.retry_after_ms,
        res.server_timings["ttft_s"], res.client_ttft_s, res.versions["revision"]

`generate` never raises on an RPC status: the status is in `res.code` (a grpc.StatusCode
name), `res.details`, and `res.retry_after_ms` (from the trailing metadata). `stream` gives
the raw messages and raises grpc.RpcError.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable

import grpc
from absl import app, flags

from serving import flags as shared
from serving.proto import SAMPLING_FIELDS, fold_tool_call
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc

PRIORITIES = {
    "default": pb.PRIORITY_UNSPECIFIED,  # the tenant's class (serving/frontend/tenants.py)
    "low": pb.PRIORITY_LOW,
    "normal": pb.PRIORITY_NORMAL,
    "high": pb.PRIORITY_HIGH,
}


@dataclasses.dataclass
class GenerateResult:
    request_id: str = ""
    code: str = "OK"  # grpc.StatusCode name
    details: str = ""
    retry_after_ms: int | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    spec_drafted_tokens: int = 0  # speculative decoding: drafts verified / accepted
    spec_accepted_tokens: int = 0
    server_timings: dict = dataclasses.field(default_factory=dict)  # queue/ttft/tpot/e2e _s
    versions: dict = dataclasses.field(default_factory=dict)
    token_times_unix_ns: list[int] = dataclasses.field(default_factory=list)  # server clock
    token_arrival_s: list[float] = dataclasses.field(default_factory=list)  # client monotonic
    num_messages: int = 0
    client_start_s: float = 0.0  # time.monotonic() when the call was sent
    client_ttft_s: float | None = None
    client_e2e_s: float | None = None
    # a chat with tools or a server reasoning parser: the text split (GenerateResponse)
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)  # pb.ToolCall, whole, in order
    reasoning_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.code == "OK"


def build_request(
    prompt: str | None = None,
    *,
    token_ids=None,
    messages=None,
    model: str = "",
    revision: str = "",
    max_tokens: int | None = None,
    min_tokens: int = 0,
    stop=(),
    stop_token_ids=(),
    ignore_eos: bool = False,
    priority: str = "default",
    stream: bool = True,
    request_id: str = "",
    adapter: str = "",
    structured: dict | None = None,
    **sampling,
) -> pb.GenerateRequest:
    """One GenerateRequest; `messages` is a list of {"role", "content"} dicts; `structured`
    one constraint such as {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling fields {sorted(unknown)}")
    req = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        revision=revision,
        adapter=adapter,
        min_tokens=min_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        priority=PRIORITIES[priority],
        stream=stream,
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
    )
    if max_tokens is not None:
        req.max_tokens = max_tokens
    for kind, value in (structured or {}).items():
        if kind == "choice":
            req.choice.choices.extend(value)
        elif kind == "json_schema" and not isinstance(value, str):
            req.json_schema = json.dumps(value)
        else:
            setattr(req, kind, value)
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        req.text = prompt
    return req


def _retry_after_ms(call) -> int | None:
    try:
        for key, value in call.trailing_metadata() or ():
            if key == "retry-after-ms":
                return int(value)
    except Exception:  # noqa: BLE001 - some failures (e.g. local deadline) carry no trailers
        return None
    return None


class GenerateClient:
    def __init__(self, target: str, api_key: str | None = None, options=None):
        self.target, self.api_key = target, api_key
        self.channel = grpc.insecure_channel(target, options=options or ())
        self.stub = pb_grpc.PagedJaxStub(self.channel)

    def __enter__(self) -> GenerateClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @property
    def metadata(self) -> tuple:
        return (("x-api-key", self.api_key),) if self.api_key else ()

    def stream(self, request: pb.GenerateRequest, timeout_s: float | None = None):
        """The raw call: iterate it for GenerateResponse messages; `.cancel()` cancels."""
        return self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout_s: float | None = None,
        on_delta: Callable[[pb.GenerateResponse], None] | None = None,
        **fields,
    ) -> GenerateResult:
        return self.generate_request(build_request(prompt, **fields), timeout_s, on_delta)

    def generate_request(
        self, request: pb.GenerateRequest, timeout_s: float | None = None, on_delta=None
    ) -> GenerateResult:
        res = GenerateResult(request_id=request.request_id, client_start_s=time.monotonic())
        call = self.stream(request, timeout_s)
        try:
            for msg in call:
                self._absorb(res, msg)
                if on_delta is not None:
                    on_delta(msg)
        except grpc.RpcError as e:
            res.code, res.details = e.code().name, e.details() or ""
            res.retry_after_ms = _retry_after_ms(e)
        res.client_e2e_s = time.monotonic() - res.client_start_s
        return res

    @staticmethod
    def _absorb(res: GenerateResult, msg: pb.GenerateResponse) -> None:
        now = time.monotonic()
        res.request_id = msg.request_id or res.request_id
        res.num_messages += 1
        if msg.token_ids and res.client_ttft_s is None:
            res.client_ttft_s = now - res.client_start_s
        res.token_ids.extend(msg.token_ids)
        res.token_arrival_s.extend([now] * len(msg.token_ids))
        res.token_times_unix_ns.extend(msg.token_times_unix_ns)
        res.text += msg.text
        res.content += msg.content
        res.reasoning_content += msg.reasoning_content
        for call in msg.tool_calls:
            fold_tool_call(res.tool_calls, call)  # fragments appended to their call
        if msg.HasField("final"):
            f = msg.final
            res.finish_reason = f.finish_reason
            res.prompt_tokens = f.usage.prompt_tokens
            res.cached_tokens = f.usage.cached_tokens
            res.completion_tokens = f.usage.completion_tokens
            res.spec_drafted_tokens = f.usage.spec_drafted_tokens
            res.spec_accepted_tokens = f.usage.spec_accepted_tokens
            res.reasoning_tokens = f.usage.reasoning_tokens
            res.server_timings = {
                k: getattr(f.timings, k) for k in ("queue_s", "ttft_s", "tpot_s", "e2e_s")
            }
            res.versions = {
                k: getattr(f.versions, k)
                for k in (
                    "name",
                    "revision",
                    "tokenizer_hash",
                    "chat_template_hash",
                    "engine_version",
                    "speculative",
                )
            }
            if f.versions.adapter:  # LoRA: the adapter that answered, and its content hash
                v = f.versions
                res.versions.update(adapter=v.adapter, adapter_hash=v.adapter_hash)

    def tokenize(self, text: str, model: str = "") -> list[int]:
        resp = self.stub.Tokenize(
            pb.TokenizeRequest(model=model, text=text), metadata=self.metadata
        )
        return list(resp.token_ids)

    def server_info(self) -> pb.ServerInfoResponse:
        return self.stub.ServerInfo(pb.ServerInfoRequest(), metadata=self.metadata)

    def list_models(self) -> pb.ListModelsResponse:
        return self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)


# ---- command line -------------------------------------------------------------------------
FLAGS = flags.FLAGS
COMMANDS = ("generate", "tokenize", "models", "info")


def define_flags() -> None:
    shared.define_target()
    shared.define_prompt()
    shared.define_sampling()
    shared.define_log_level()
    flags.DEFINE_alias("timeout_s", "request_timeout_s")  # the name before the shared vocabulary
    flags.DEFINE_bool("chat", True, "deprecated, chat is the default (--raw sends the text as is)")
    flags.DEFINE_bool("stream", True, "print tokens as they arrive")
    flags.DEFINE_string("model", "", "model name the server must be serving ('': any)")
    flags.DEFINE_string("revision", "", "revision the server must be serving ('': any)")
    flags.DEFINE_enum(
        "priority", "default", list(PRIORITIES), "request priority class (default: the tenant's)"
    )


def check_flags(argv) -> str:
    """The command (generate by default), after checking every flag; UsageError if wrong."""
    command = argv[1] if len(argv) > 1 else "generate"
    shared.require(
        "", command, len(argv) <= 2 and command in COMMANDS, f"command: one of {list(COMMANDS)}"
    )
    shared.check_target("target", FLAGS.target)
    shared.check_positive("request_timeout_s", FLAGS.request_timeout_s, allow_none=True)
    if command in ("generate", "tokenize"):
        shared.require("prompt", "''", bool(FLAGS.prompt), "must not be empty")
    if command == "generate":
        shared.check_sampling(
            max_tokens=FLAGS.max_tokens,
            temperature=FLAGS.temperature,
            top_p=FLAGS.top_p,
            top_k=FLAGS.top_k,
            seed=FLAGS.seed,
        )
    return command


def main(argv) -> int:
    shared.setup_logging(FLAGS.log_level)
    command = check_flags(argv)
    shared.wait_for_server(FLAGS.target)
    with GenerateClient(FLAGS.target, FLAGS.api_key) as client:
        try:
            if command != "generate":
                print(_query(client, command))
                return 0
        except grpc.RpcError as e:
            print(f"[{e.code().name}] {e.details()}", file=sys.stderr)
            return 1
        res = client.generate(timeout_s=FLAGS.request_timeout_s, on_delta=_show, **_fields())
    print()
    print(format_summary(res))
    return 0 if res.ok else 1


def _fields() -> dict:
    fields = {
        "model": FLAGS.model,
        "revision": FLAGS.revision,
        "max_tokens": FLAGS.max_tokens,
        "temperature": FLAGS.temperature,
        "top_p": FLAGS.top_p,
        "top_k": max(FLAGS.top_k, 0),
        "seed": FLAGS.seed,
        "priority": FLAGS.priority,
        "stream": FLAGS.stream,
    }
    if FLAGS.raw or not FLAGS.chat:
        return {**fields, "prompt": FLAGS.prompt}
    system = [{"role": "system", "content": FLAGS.system}] if FLAGS.system else []
    return {**fields, "messages": [*system, {"role": "user", "content": FLAGS.prompt}]}


def _show(msg) -> None:
    sys.stdout.write(msg.text)
    sys.stdout.flush()


def _query(client: GenerateClient, command: str) -> str:
    """tokenize / models / info, printed as JSON."""
    from google.protobuf.json_format import MessageToJson

    if command == "tokenize":
        ids = client.tokenize(FLAGS.prompt, model=FLAGS.model)
        return json.dumps({"text": FLAGS.prompt, "token_ids": ids, "num_tokens": len(ids)})
    reply = client.list_models() if command == "models" else client.server_info()
    return MessageToJson(reply, preserving_proto_field_name=True)


def format_summary(res: GenerateResult) -> str:
    if not res.ok:
        hint = f" retry-after-ms={res.retry_after_ms}" if res.retry_after_ms is not None else ""
        return f"[{res.code}] {res.details}{hint}"
    t = res.server_timings
    return (
        f"[{res.finish_reason}] prompt={res.prompt_tokens} cached={res.cached_tokens} "
        f"completion={res.completion_tokens} | server: queue={t['queue_s'] * 1e3:.1f}ms "
        f"ttft={t['ttft_s'] * 1e3:.1f}ms tpot={t['tpot_s'] * 1e3:.2f}ms "
        f"e2e={t['e2e_s'] * 1e3:.1f}ms | client: ttft="
        f"{(res.client_ttft_s or 0) * 1e3:.1f}ms e2e={(res.client_e2e_s or 0) * 1e3:.1f}ms | "
        f"{res.versions.get('name')}@{res.versions.get('revision')} "
        f"engine={res.versions.get('engine_version')}"
    )


def run() -> None:
    define_flags()
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)


if __name__ == "__main__":
    run()

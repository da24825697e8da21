"""Generated gRPC stubs for serving/proto/pagedjax.proto (see regen.sh)."""

# The optional sampling fields of `GenerateRequest` (proto3 `optional`: HasField tells "unset"
# from zero); the client fills them and serving.grpc_api.convert reads them, by these names.
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
)


def fold_tool_call(calls, call) -> None:
    """Appends a GenerateResponse.tool_calls delta to `calls` (a repeated ToolCall field or
    a list): a fragment (no id) extends the arguments of the call with its index; a call's
    first delta (with id) starts a new entry."""
    if not call.id:
        for c in reversed(calls):
            if c.index == call.index:
                c.arguments += call.arguments
                return
    entry = calls.add() if hasattr(calls, "add") else type(call)()
    entry.CopyFrom(call)
    if not hasattr(calls, "add"):
        calls.append(entry)

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

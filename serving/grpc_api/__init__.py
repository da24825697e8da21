"""The gRPC API: the PagedJax service and what only gRPC needs.

    service.py       the gRPC handlers (GenerateCall from protobuf -> frontend Generator)
    convert.py       protobuf <-> engine types (HTTP borrows its version and chat helpers)
    chat.py          tools / reasoning fields <-> engine/chat (the HTTP API's own code)
    guard.py         RequestGuard interceptor: authentication, message size, parsing
    dispatch.py      outcomes for calls that never reach their handler (interceptor)
    input_limits.py  cheap bounds on a request's raw protobuf fields
    transport.py     gRPC port binding and message-size settings

May import: engine, serving/frontend/, serving/proto/. Never serving/http/.
"""

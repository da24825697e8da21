"""Building and hosting the engine the server drives.

    build.py        build_engine: the mock or the real EngineCore, and its warm-up
    process.py      the engine in a child process, behind the same interface
    mock_engine.py  MockEngine: the real engine host code, a hand-checkable fake device

May import: engine, configs, models, serving/flags.py. Never serving/frontend/,
grpc_api/ or http/.
"""

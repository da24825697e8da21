"""What a chat model's output means beyond text, and the request side that goes with it:
tool calls and reasoning split from the answer, transport-neutral (the HTTP API, the gRPC
service and `LLM.chat` share it).

    tool_parsers.py  a family's call markup <-> tool calls (hermes, llama3_json, mistral)
    call_stream.py   ToolCallStream: output text -> content and calls as it streams (whole
                     calls, or name-first with argument fragments when a grammar holds them)
    call_section.py  CallSection: one call section as it is written (incremental reading)
    json_scan.py     JSON read character by character (a call's name, its growing arguments)
    reasoning.py     <think>...</think> apart from the answer; the thinking-budget grammar
    output.py        ChatOutput: one choice's output split as it streams (OpenAI deltas)
    setup.py         ChatOptions / ChatSetup: tools and choice checked, the template's
                     inputs, the call grammar that makes forced calls valid by construction

May import: configs, models, engine.errors, engine.sampling, engine.structured. Never serving.
"""

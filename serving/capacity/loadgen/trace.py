"""Trace replay: a JSONL file of requests with their arrival times.

One JSON object per line:

    {"arrival_s": 0.25, "prompt_tokens": 120, "output_tokens": 64,
     "tenant": "acme", "priority": 1, "workload": "chat", "prompt": "optional text",
     "cancel_after_tokens": null}

`arrival_s` is seconds from the start of the trace (sorted on load). `prompt` is optional: when
it is missing, a prompt of `prompt_tokens` tokens is built from the corpus. `output_tokens` is
sent as max_tokens. A run can save what it sent as a trace (`--save_trace`), so a captured or
privacy-processed trace and a synthetic one replay the same way.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import uuid

from serving.capacity.loadgen.workloads import Corpus, RequestSpec


@dataclasses.dataclass
class TraceEntry:
    arrival_s: float
    prompt_tokens: int = 0
    output_tokens: int = 16
    tenant: str = "default"
    priority: int = 0
    workload: str = "trace"
    prompt: str | None = None
    cancel_after_tokens: int | None = None

    def __post_init__(self):
        if self.arrival_s < 0:
            raise ValueError(f"arrival_s={self.arrival_s}: must be >= 0")
        if self.prompt is None and self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={self.prompt_tokens}: needs >= 1 or a prompt")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens={self.output_tokens}: must be >= 1")


def load_trace(path: str | pathlib.Path) -> list[TraceEntry]:
    """Entries sorted by arrival time; names the line of a malformed entry."""
    fields = {f.name for f in dataclasses.fields(TraceEntry)}
    entries = []
    for lineno, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            entries.append(TraceEntry(**{k: v for k, v in obj.items() if k in fields}))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: bad trace entry: {e}") from e
    return sorted(entries, key=lambda e: e.arrival_s)


def save_trace(path: str | pathlib.Path, entries: list[TraceEntry]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(dataclasses.asdict(e)) + "\n" for e in entries)


def specs_from_trace(
    entries: list[TraceEntry], speedup: float = 1.0, seed: int = 0, corpus: Corpus | None = None
) -> list[RequestSpec]:
    """RequestSpecs whose arrival times are the trace's, divided by `speedup`."""
    if speedup <= 0:
        raise ValueError(f"speedup={speedup}: must be > 0")
    corpus = corpus or Corpus()
    rng = random.Random(seed)
    run_tag = uuid.uuid4().hex[:8]  # ids unique across runs; prompts stay seeded
    specs = []
    for i, e in enumerate(entries):
        prompt = e.prompt if e.prompt is not None else corpus.text(e.prompt_tokens, rng)
        specs.append(
            RequestSpec(
                f"tr-{run_tag}-{i:06d}",
                e.workload,
                prompt,
                e.prompt_tokens,
                e.output_tokens,
                e.tenant,
                e.priority,
                e.cancel_after_tokens,
                e.arrival_s / speedup,
            )
        )
    return specs


def entry_from_spec(spec: RequestSpec, arrival_s: float) -> TraceEntry:
    """What a run sent, as a replayable trace entry (prompt text kept)."""
    return TraceEntry(
        arrival_s,
        spec.prompt_tokens_target,
        spec.max_tokens,
        spec.tenant,
        spec.priority,
        spec.workload,
        spec.prompt,
        spec.cancel_after_tokens,
    )

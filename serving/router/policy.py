"""Where the router sends a request: prefix affinity over a consistent-hash ring with
bounded loads (plain Python, no gRPC; serving/router/server.py uses it).

Prefix key. The router has no tokenizer, so it cuts the prompt as the client sent it into
blocks (text: `block_bytes` UTF-8 bytes, about a 16-token cache page at 64 bytes; token ids:
`block_tokens` ids; chat: the messages' JSON) and chains the hashes of the first
`num_blocks` FULL blocks, like the engine's page keys (engine/sched/page_pool.py). Prompts sharing
a system prompt of at least `num_blocks` blocks get one key, so they land where that prefix
is cached; a prompt shorter than one block is keyed by all of it.

Ring. Each worker owns `vnodes` points (blake2b of "address#i") on a 64-bit ring; a key goes
to the first point clockwise. Adding or removing a worker moves only the keys of the arcs
it gains or loses (about 1/n of them), so a dead replica does not reshuffle everyone's
caches.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads"):
walking clockwise from the key, the first healthy worker whose load (requests in flight
through this router) is below ceil(c * (total + 1) / n) takes the request; c = 1.25 by
default. A hot prefix therefore spills to the next workers on the ring (the same ones each
time, so they warm up too) instead of queueing behind one replica.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence

from serving.proto import pagedjax_pb2 as pb


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prompt_blocks(
    request: pb.GenerateRequest, block_bytes: int, block_tokens: int
) -> tuple[list[bytes], bool]:
    """(blocks, last_is_full): the prompt cut into blocks; the last one may be partial."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        cuts = [ids[i : i + block_tokens] for i in range(0, len(ids), block_tokens)]
        full = bool(cuts) and len(cuts[-1]) == block_tokens
        return [json.dumps(c).encode() for c in cuts], full
    if kind == "chat":
        data = json.dumps([[m.role, m.content] for m in request.chat.messages]).encode()
    else:
        data = request.text.encode()
    cuts = [data[i : i + block_bytes] for i in range(0, len(data), block_bytes)]
    return cuts, bool(cuts) and len(cuts[-1]) == block_bytes


def prefix_key(
    request: pb.GenerateRequest, num_blocks: int = 4, block_bytes: int = 64, block_tokens: int = 16
) -> int:
    """Chained hash of the first `num_blocks` full blocks (all of a one-block prompt)."""
    blocks, last_full = prompt_blocks(request, block_bytes, block_tokens)
    full = blocks if last_full else blocks[:-1]
    key = 0
    for block in (full or blocks)[:num_blocks]:
        key = _h64(key.to_bytes(8, "big") + block)
    return key


class HashRing:
    def __init__(self, members: Sequence[str], vnodes: int = 64):
        points = sorted((_h64(f"{m}#{i}".encode()), m) for m in members for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [m for _, m in points]
        self.members = list(dict.fromkeys(members))

    def walk(self, key: int) -> list[str]:
        """Every member once, in ring order starting at the key's successor."""
        if not self._owners:
            return []
        start = bisect.bisect(self._hashes, key % (1 << 64))
        order: list[str] = []
        for i in range(len(self._owners)):
            m = self._owners[(start + i) % len(self._owners)]
            if m not in order:
                order.append(m)
                if len(order) == len(self.members):
                    break
        return order


def pick_bounded(
    ring: HashRing,
    key: int,
    load: Callable[[str], int],
    usable: Callable[[str], bool],
    c: float = 1.25,
) -> tuple[str | None, bool]:
    """(worker, spilled): the first usable worker clockwise from `key` under the load bound;
    spilled is True when it is not the key's first usable worker."""
    candidates = [m for m in ring.walk(key) if usable(m)]
    if not candidates:
        return None, False
    total = sum(load(m) for m in candidates)
    bound = math.ceil(c * (total + 1) / len(candidates))
    for i, m in enumerate(candidates):
        if load(m) < bound:
            return m, i > 0
    return min(candidates, key=load), True  # unreachable with c >= 1; kept for safety


class RoundRobin:
    """The baseline the benchmark compares against (destroys prefix reuse)."""

    def __init__(self):
        self._counter = itertools.count()

    def pick(self, members: Sequence[str], usable: Callable[[str], bool]) -> str | None:
        alive = [m for m in members if usable(m)]
        return alive[next(self._counter) % len(alive)] if alive else None

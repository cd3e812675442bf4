"""Where `kvtier router` sends a request: a key naming the conversation's prefix, a consistent-hash
ring over the replicas, and bounded loads. Pure functions and one small class; no I/O.

The key: a chat request is named by its messages up to and including the first user message
(the system prompt and the opening question), which every later turn of the same conversation
repeats verbatim, so a returning conversation hashes to the same replica however long it grows. A
completion is named by the first `prefix_chars` characters of its prompt (or the first ids of a
token-id prompt): text, not tokens, so the router needs no tokenizer and no extra round trip; two
prompts that share those characters share their first KV blocks on the replica too.

The ring: each replica sits at `vnodes` points hashed from its URL; a key goes to the first
replica clockwise from its own hash, and when that replica is down only its keys move.
Bounded loads (consistent hashing with bounded loads): a replica already running more than
`load_factor` times the mean in-flight count is passed over for the next one on the ring, so one
hot prefix cannot pile every request onto one replica.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash


def _hash(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _text(content: Any) -> str:
    """A message's content as text: a string, or its parts (text parts as text, others as JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"]
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else json.dumps(p, sort_keys=True)
            for p in content
        )
    return json.dumps(content, sort_keys=True)


def route_key(path: str, body: Any, prefix_chars: int) -> bytes:
    """The routing key of a request to `path` with JSON `body` (already parsed; anything else is
    keyed by its repr). Chat: the messages through the first user message; completions: the first
    `prefix_chars` characters of the (first) prompt."""
    if not isinstance(body, dict):
        return repr(body)[:prefix_chars].encode()
    if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        parts: list[str] = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                break
            parts.append(f"{m.get('role')}\0{_text(m.get('content'))}\0")
            if m.get("role") == "user":
                break
        return ("chat\0" + "".join(parts)).encode()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts: keyed by the first
    if isinstance(prompt, list):  # token ids: about four characters a token
        return ("ids\0" + json.dumps(prompt[: max(1, prefix_chars // 4)])).encode()
    return ("text\0" + str(prompt)[:prefix_chars]).encode()


class HashRing:
    """Replicas (by name) at `vnodes` points each on a 64-bit hash ring."""

    def __init__(self, names: Sequence[str], vnodes: int = 64) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a ring needs distinct replica names, got {list(names)}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        points = sorted((_hash(f"{n}#{i}".encode()), n) for n in names for i in range(vnodes))
        self.names = list(names)
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def order(self, key: bytes) -> list[str]:
        """Every replica once, in ring order from `key`'s point: the owner first."""
        out: list[str] = []
        start = bisect_right(self._points, _hash(key))
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in out:
                out.append(owner)
                if len(out) == len(self.names):
                    break
        return out


def attempt_order(
    ring_order: Sequence[str],
    healthy: Iterable[str],
    in_flight: Mapping[str, int],
    load_factor: float,
) -> list[str]:
    """Replicas to try, in order: the first healthy one in ring order whose load is within the
    bound, then the other healthy ones in ring order, then the unhealthy ones (a last resort:
    health checks lag behind a replica coming back)."""
    alive = set(healthy)
    up = [n for n in ring_order if n in alive]
    down = [n for n in ring_order if n not in up]
    if not up:
        return down
    total = sum(in_flight.get(n, 0) for n in up)
    bound = math.ceil(load_factor * (total + 1) / len(up))
    first = next((n for n in up if in_flight.get(n, 0) < bound), up[0])
    return [first] + [n for n in up if n != first] + down

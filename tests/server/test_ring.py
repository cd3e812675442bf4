"""The router's routing rules, without I/O: conversation keys that survive new turns, a ring that
moves only a lost replica's keys, bounded loads, and the router's flag checks."""

from __future__ import annotations

from collections import Counter

import pytest

from kvtier.config import RouterConfig
from kvtier.server.ring import HashRing, attempt_order, route_key

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
NAMES = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def chat(*contents: str, system: str | None = "be brief") -> dict[str, object]:
    roles = ["user", "assistant"] * len(contents)
    msgs = [{"role": r, "content": c} for r, c in zip(roles, contents)]
    return {"messages": ([{"role": "system", "content": system}] if system else []) + msgs}


def test_a_chat_key_survives_new_turns_and_names_the_opening() -> None:
    first = route_key(CHAT, chat("What is a block?"), 256)
    assert route_key(CHAT, chat("What is a block?", "A page.", "And a tier?"), 256) == first
    parts = {"messages": [{"role": "system", "content": "be brief"}]}
    parts["messages"].append(
        {"role": "user", "content": [{"type": "text", "text": "What is a block?"}]}
    )
    assert route_key(CHAT, parts, 256) == first  # content parts read as their text
    assert route_key(CHAT, chat("What is a page?"), 256) != first
    assert route_key(CHAT, chat("What is a block?", system="be long"), 256) != first


def test_a_completion_key_is_its_prompt_prefix() -> None:
    long = "x" * 300
    assert route_key(CMPL, {"prompt": long + "a"}, 256) == route_key(
        CMPL, {"prompt": long + "b"}, 256
    )
    assert route_key(CMPL, {"prompt": "ab"}, 256) != route_key(CMPL, {"prompt": "ac"}, 256)
    assert route_key(CMPL, {"prompt": [long + "a", "z"]}, 256) == route_key(
        CMPL, {"prompt": long}, 256
    )
    ids = list(range(100))
    assert route_key(CMPL, {"prompt": ids}, 256) == route_key(CMPL, {"prompt": [*ids, 7]}, 256)
    assert route_key(CMPL, {"prompt": [ids]}, 256) == route_key(CMPL, {"prompt": ids}, 256)
    for junk in (None, 3, "text", [1, "a"], {"prompt": {"x": 1}}):  # no crash; replicas answer 400
        assert isinstance(route_key(CMPL, junk, 256), bytes)


def test_the_ring_spreads_keys_and_moves_only_a_lost_replicas_keys() -> None:
    ring = HashRing(NAMES)
    keys = [f"conversation {i}".encode() for i in range(3000)]
    owners = {k: ring.order(k)[0] for k in keys}
    assert all(sorted(ring.order(k)) == sorted(NAMES) for k in keys[:50])
    share = Counter(owners.values())
    assert all(700 < share[n] < 1300 for n in NAMES), share  # 64 points each: near a third
    smaller = HashRing(NAMES[:2])
    for k in keys:
        if owners[k] != NAMES[2]:
            assert smaller.order(k)[0] == owners[k]  # keys of surviving replicas stay put
        else:
            assert smaller.order(k)[0] == ring.order(k)[1]  # the lost one's keys: next on the ring
    assert HashRing(list(reversed(NAMES))).order(keys[0]) == ring.order(keys[0])  # order-free


def test_attempts_prefer_the_owner_skip_the_overloaded_and_keep_the_down_last() -> None:
    order = ["a", "b", "c"]
    idle = {"a": 0, "b": 0, "c": 0}
    assert attempt_order(order, {"a", "b", "c"}, idle, 1.25) == ["a", "b", "c"]
    assert attempt_order(order, {"b", "c"}, idle, 1.25) == ["b", "c", "a"]
    busy = {"a": 9, "b": 1, "c": 2}  # mean 4, bound ceil(1.25 × 13 / 3) = 6: a is passed over
    assert attempt_order(order, {"a", "b", "c"}, busy, 1.25) == ["b", "a", "c"]
    near = {"a": 2, "b": 1, "c": 2}  # bound ceil(1.25 × 6 / 3) = 3: a stays first
    assert attempt_order(order, {"a", "b", "c"}, near, 1.25) == ["a", "b", "c"]
    assert attempt_order(order, set(), idle, 1.25) == ["a", "b", "c"]  # all down: try anyway


@pytest.mark.parametrize(
    "kwargs",
    [
        {"replicas": ()},
        {"replicas": ("127.0.0.1:8001",)},
        {"replicas": ("http://127.0.0.1:8001/v1",)},
        {"replicas": ("http://a:1", "http://a:1")},
        {"replicas": ("http://a:1",), "port": 0},
        {"replicas": ("http://a:1",), "load_factor": 0.5},
        {"replicas": ("http://a:1",), "health_interval_s": 0.0},
        {"replicas": ("http://a:1",), "route_prefix_chars": 0},
    ],
)
def test_bad_router_settings_are_value_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


def test_a_ring_needs_distinct_names() -> None:
    with pytest.raises(ValueError):
        HashRing(["a", "a"])
    with pytest.raises(ValueError):
        HashRing([])

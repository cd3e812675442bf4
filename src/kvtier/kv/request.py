"""The token sequence the KV layer sees: ids, optimistic computed count, chained block hashes.

`sched.Request` builds on this; the KV layer never needs more of a request than this class holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.ids import BlockHash
from kvtier.kv.hashing import BlockHasher, HashExtras


class KVSequence:
    """A request's tokens and their block hashes (at the hasher's block size), kept in step."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        hasher: BlockHasher | None = None,
        extras: HashExtras | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        if not self.all_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; send at least one token")
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0  # optimistic: advanced at schedule time
        self.hasher = hasher
        self.extras = extras
        self.block_hashes: list[BlockHash] = []
        self._rehash()

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known to the host (drafts and placeholders excluded)."""
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append sampled tokens and hash any block they complete (mutates)."""
        self.all_token_ids.extend(token_ids)
        self._rehash()

    def _rehash(self) -> None:
        if self.hasher is not None:
            self.hasher.extend(self.block_hashes, self.all_token_ids, self.extras)

"""Incremental detokenization and stop strings: turns sampled token ids into text deltas without
re-decoding the whole output, holds back incomplete UTF-8, and cuts the text at a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """One request's output text. `push(token_id)` returns the new text; `stop_reason` is the stop
    string that ended the text (None while running). Stop strings are left out of `text` unless
    `include_stop_str_in_output`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        # Decode with up to a few prompt tokens of context so a leading space renders as the
        # tokenizer would render it mid-text.
        self.token_ids: list[int] = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stop_reason: str | None = None

    def push(self, token_id: int) -> str:
        """Append one token; returns the text it completes (may be "" while bytes are partial)."""
        if self.stop_reason is not None:
            return ""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._append(delta)

    def _append(self, delta: str) -> str:
        before = len(self.text)
        self.text += delta
        if not self.stop:
            return delta
        longest = max(len(s) for s in self.stop)
        search_from = max(0, before - longest + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return delta
        index, stop = min(hits)
        self.stop_reason = stop
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return self.text[before:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

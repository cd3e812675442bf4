"""Incremental detokenization and stop strings: turns sampled token ids into text deltas without
re-decoding the whole output, holds back incomplete UTF-8 and text that may start a stop string,
and cuts the text at a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """One request's output text. `push(token_id)` returns the text that became final, `flush()`
    the rest once the request ends; together they add up to `text`. `stop_reason` is the stop
    string that ended the text (None while running). Stop strings are left out of `text` unless
    `include_stop_str_in_output`, and match only once they end past the first `min_tokens`
    output tokens (as vLLM)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        prompt_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Decode with up to a few prompt tokens of context so a leading space renders as the
        # tokenizer would render it mid-text.
        self.token_ids: list[int] = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.num_output_tokens = 0
        self.text = ""
        # INVARIANT: text[:num_sent] was returned and is final (a prefix of every later `text`).
        self.num_sent = 0
        self.stop_reason: str | None = None

    def push(self, token_id: int) -> str:
        """Append one output token; returns the text that is now final (may be "" while bytes of
        a character are partial, or while the text's end may begin a stop string)."""
        if self.stop_reason is not None:
            return ""
        self.num_output_tokens += 1
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._append(full[len(prefix) :])
        end = len(self.text) if self.stop_reason is not None else len(self.text) - self._held()
        return self._release(end)

    def flush(self) -> str:
        """The request ended: returns the text still held back (it can match nothing now)."""
        return self._release(len(self.text))

    def _append(self, delta: str) -> None:
        before = len(self.text)
        self.text += delta
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return
        # A stop must end in the new text (earlier ends were checked, or were within min_tokens).
        hits = [(self.text.find(s, max(0, before - len(s) + 1)), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)  # the earliest start among stops ending in this delta
            self.stop_reason = stop
            self.text = self.text[: index + len(stop) if self.include_stop else index]

    def _held(self) -> int:
        """Length of the longest end of `text` that begins some stop string (0 if a match would
        be kept in the output anyway: it cannot cut text already sent)."""
        if self.include_stop:
            return 0
        text, held = self.text, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _release(self, end: int) -> str:
        delta = self.text[self.num_sent : end]
        self.num_sent = max(self.num_sent, end)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

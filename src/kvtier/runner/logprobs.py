"""Logprob records of the runner: what a forward leaves on the device (`LogprobRows`, tensors and
whose rows they are) and what the host reads from it once the step's event completed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of a token (sampled, or of the prompt) and the top candidates at its position."""

    logprob: float
    top: dict[int, float]


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens at positions start, start + 1, ... (one step's chunk)."""

    start: int  # ≥ 1: the first prompt token has no logprob
    logprobs: list[TokenLogprobs]


@dataclass(slots=True)
class LogprobRows:
    """Logprob tensors of one forward, read on the host once the step's event completed."""

    token: torch.Tensor  # [rows] float32: the logprob of each row's token
    top_values: torch.Tensor  # [rows, k] float32, k = the largest request's
    top_ids: torch.Tensor  # [rows, k] int64
    spans: list[tuple[str, int, int, int, int]]  # req, first row, rows, its k, first position

    def read(self) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Per request: (first position, its rows as TokenLogprobs). Host reads: after the event."""
        token, values, ids = self.token.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return {
            req_id: (
                pos,
                [
                    TokenLogprobs(token[r], dict(zip(ids[r][:k], values[r][:k], strict=True)))
                    for r in range(first, first + n)
                ],
            )
            for req_id, first, n, k, pos in self.spans
        }

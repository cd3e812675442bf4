"""What a forward leaves on the device for logprobs (`LogprobRows`: tensors and whose rows they
are), read by the host into the contract's `TokenLogprobs` once the step's event completed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.sched.output import TokenLogprobs


@dataclass(slots=True)
class LogprobRows:
    """Logprob tensors of one forward, read on the host once the step's event completed."""

    token: torch.Tensor  # [rows] float32: the logprob of each row's token
    top_values: torch.Tensor  # [rows, k] float32, k = the largest request's
    top_ids: torch.Tensor  # [rows, k] int64
    spans: list[tuple[str, int, int, int, int]]  # req, first row, rows, its k, first position

    def to_host(self) -> LogprobRows:
        """The rows with their tensors copied to host memory (queued on the current stream)."""
        return LogprobRows(
            self.token.to("cpu", non_blocking=True),
            self.top_values.to("cpu", non_blocking=True),
            self.top_ids.to("cpu", non_blocking=True),
            self.spans,
        )

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

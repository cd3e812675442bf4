"""Device-side request state of the runner: what the device knows of each request — its row in
the token buffer, how many tokens it holds, its position, block tables — and the token buffer.

Mutated only inside ops on the compute stream (declared as the `token_state` buffer), so under
async scheduling it runs ahead of the host exactly as the device does. The Python half holds
counts and ids the host already knew; token values the device sampled stay in the buffer, so no
op waits for the device to read them (except n-gram drafts, see `DeviceState.track_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.model.grammar import Matcher
from kvtier.sampling import DrawParams
from kvtier.sched.output import SchedulerOutput


@dataclass(slots=True)
class DeviceRequest:
    row: int  # its row of the token buffer
    num_tokens: int  # tokens the device holds: prompt + every token sampled so far
    position: int  # tokens whose KV is written: the next query position
    tables: list[list[int]]  # block ids per KV-cache group (0 = null block)
    params: DrawParams
    known_ids: list[int]  # the tokens the host sent (prompt, and outputs when it resumed)
    num_prompt_tokens: int
    min_tokens: int = 0
    eos_ids: tuple[int, ...] = field(default_factory=tuple)  # banned until min_tokens outputs
    num_prompt_logprobs: int | None = None  # top candidates per prompt token; None: not asked
    token_ids: list[int] | None = None  # every token, kept only when drafts are proposed on them
    grammar: Matcher | None = None  # structured outputs: the grammar after every token it holds


class DeviceState:
    """Every request the device knows, and their tokens in `tokens` [rows, max_model_len]."""

    def __init__(
        self, num_rows: int, max_model_len: int, device: torch.device, track_tokens: bool
    ) -> None:
        self.requests: dict[str, DeviceRequest] = {}
        self.tokens = torch.zeros(num_rows, max_model_len, dtype=torch.int64, device=device)
        self.device = device
        # n-gram drafts are proposed on the device's own tokens, in Python: only then does the
        # forward read what it sampled back to the host (a wait on the compute stream's worker)
        self.track_tokens = track_tokens
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def __getitem__(self, req_id: str) -> DeviceRequest:
        return self.requests[req_id]

    def apply_diffs(self, output: SchedulerOutput, eos_ids: tuple[int, ...]) -> None:
        """Bring the state to the tables of step `output` (drops, new requests, appended blocks).

        A new request's prompt logprobs are computed only on its first run, not again when it
        resumes with outputs (they were delivered with its first output)."""
        for req_id in (*output.preempted_req_ids, *output.finished_req_ids):
            gone = self.requests.pop(req_id, None)
            if gone is not None:
                self._free_rows.append(gone.row)
        new_rows: list[int] = []
        new_ids: list[list[int]] = []
        for new in output.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)  # resumed before its drop was applied
            row = old.row if old is not None else self._free_rows.pop()
            ids = list(new.token_ids)
            self.requests[new.req_id] = DeviceRequest(
                row=row,
                num_tokens=len(ids),
                position=new.num_computed_tokens,
                tables=[list(t) for t in new.block_ids],
                params=new.draw,
                known_ids=ids,
                num_prompt_tokens=new.num_prompt_tokens,
                min_tokens=new.stop.min_tokens,
                # as vLLM's all_stop_token_ids: EOS is banned before min_tokens even with ignore_eos
                eos_ids=eos_ids + new.stop.stop_token_ids,
                num_prompt_logprobs=new.draw.prompt_logprobs
                if len(ids) == new.num_prompt_tokens
                else None,
                token_ids=list(ids) if self.track_tokens else None,
            )
            new_rows.append(row)
            new_ids.append(ids)
        if new_rows:
            self.write_known(new_rows, new_ids)
        for cached in output.scheduled_cached_reqs:
            st = self.requests[cached.req_id]
            for table, ids in zip(st.tables, cached.new_block_ids, strict=True):
                table.extend(ids)

    def write_known(self, rows: list[int], ids: list[list[int]]) -> None:
        """Copy host-known token ids into the buffer from position 0 of each row."""
        flat = [t for seq in ids for t in seq]
        row_idx = [r for r, seq in zip(rows, ids, strict=True) for _ in seq]
        pos_idx = [p for seq in ids for p in range(len(seq))]
        self.scatter(row_idx, pos_idx, host_index(flat, self.device))

    def gather(self, row_idx: list[int], pos_idx: list[int]) -> torch.Tensor:
        """[n] int64 token ids at (row, position) pairs, on the device."""
        return self.tokens.view(-1).index_select(0, self._flat(row_idx, pos_idx))

    def scatter(self, row_idx: list[int], pos_idx: list[int], values: torch.Tensor) -> None:
        """Write values [n] (int64, on the device) at (row, position) pairs."""
        self.tokens.view(-1).index_copy_(0, self._flat(row_idx, pos_idx), values)

    def _flat(self, row_idx: list[int], pos_idx: list[int]) -> torch.Tensor:
        """Element indices of (row, position) pairs in the flat buffer: one index tensor, where a
        two-tensor index would cost four more torch calls a step (each one a GIL hand-off)."""
        width = self.tokens.shape[1]
        return host_index(
            [r * width + p for r, p in zip(row_idx, pos_idx, strict=True)], self.device
        )


def host_index(values: list[int], device: torch.device) -> torch.Tensor:
    """A host-built int64 tensor on `device` (`on_device`)."""
    return on_device(torch.tensor(values, dtype=torch.int64), device)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, queued without a wait (the host knows it). On the host CPU
    itself no call is made: each torch call releases and retakes the GIL, which in a server
    means waiting on the engine loop."""
    return t if device.type == "cpu" and device.index is None else t.to(device, non_blocking=True)

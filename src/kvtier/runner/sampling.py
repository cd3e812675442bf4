"""StepSampler: the sampling half of a forward op, from the hidden states of a step's last known
positions to its next tokens (grammar masks, penalties and bans, the draw, draft acceptance,
matchers advanced on accepted tokens only: architecture.md §Grammar). It runs only inside the
forward op and never decides which positions run: the runner's plan says."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvtier.model import native
from kvtier.model.adjust import Adjustments, RowHistory
from kvtier.model.attention import AttentionMetadata
from kvtier.model.grammar import Grammars, MaskFill, apply_mask
from kvtier.model.sampler import SamplingBatch, sample
from kvtier.model.served import ServedModel
from kvtier.runner.logprobs import LogprobRows
from kvtier.runner.state import DeviceRequest, DeviceState, host_index, on_device
from kvtier.sampling import DrawParams
from kvtier.sched.output import SchedulerOutput

NO_HISTORY = RowHistory(0, 0, 0)  # a row whose logits nothing adjusts reads no past tokens
Masks = tuple[torch.Tensor, list[int]]  # [rows, ceil(vocab / 32)] int32 bitmask, rows it binds


@dataclass(slots=True)
class Planned:
    """One request's share of a forward."""

    req_id: str
    state: DeviceRequest
    start: int  # first query position (the device's, after any draft rollback)
    num_real: int  # tokens known before the step (prompt chunk or the last sampled token)
    drafts: list[int]
    samples: bool  # the step reaches the end of the known tokens: sample after it


@dataclass(slots=True)
class Drawn:
    """What one forward's sampling leaves for the step's results."""

    logprobs: LogprobRows | None  # rows of the requests that asked for logprobs
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which accepted


# A sampling request in a step: its plan, its first logits row, its row of the sampled buffer.
Sampling = list[tuple[Planned, int, int]]


class StepSampler:
    """Samples the rows of a forward for `model` into `sampled` ([max_num_seqs, 1 + k] int64,
    row i: the step's i-th request) and `state`'s token buffer. `grammars`: None serves no
    structured outputs; `logprobs_mode` as vLLM's (model.sampler.LOGPROBS_MODES)."""

    def __init__(
        self,
        model: ServedModel,
        state: DeviceState,
        sampled: torch.Tensor,
        torch_device: torch.device,
        *,
        seed: int,
        logprobs_mode: str,
        grammars: Grammars | None,
    ) -> None:
        self.model = model
        self.state = state
        self.sampled = sampled
        self.torch_device = torch_device
        self.logprobs_mode = logprobs_mode
        self.grammars = grammars
        self.generator = torch.Generator(device=self.torch_device).manual_seed(seed)
        self._mask_thread: ThreadPoolExecutor | None = None  # fills masks beside the forward

    def start_matchers(self, output: SchedulerOutput) -> None:
        """A matcher for every new request with a grammar, advanced over the outputs it resumes
        with: after a preemption, a prefix hit or a load, its place in the grammar is rebuilt
        from the tokens the host knows (architecture.md §Grammar)."""
        for new in output.scheduled_new_reqs:
            spec = new.draw.grammar
            if spec is None or self.grammars is None:
                continue
            outputs = new.token_ids[new.num_prompt_tokens :]
            self.state[new.req_id].grammar = self.grammars.matcher(spec, outputs)

    def start_masks(self, plan: list[Planned]) -> Future[Masks | None]:
        """The grammar masks of this step's sampled rows (`_prepare`), their llguidance calls on
        the sampler's mask thread, so the masks are filled while the model's forward runs (on
        cpu the forward computes on the op's thread, on cuda it queues kernels). The Python part
        (the jobs, the mask tensor) runs here first: on the mask thread it would take the GIL
        from the forward (`MaskFill`). Nothing else touches the matchers until `sample`, which
        takes the masks from the future. Done at once when no sampled row has a grammar."""
        fill = self._prepare(plan)
        if fill is None:
            done: Future[Masks | None] = Future()
            done.set_result(None)
            return done
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._mask_thread.submit(self._fill_beside_forward, fill)

    @staticmethod
    def _fill_beside_forward(fill: MaskFill) -> Masks:
        with native.pool_yield():  # the forward's idle kernel threads leave the fill a core
            return fill.run()

    def _prepare(self, plan: list[Planned]) -> MaskFill | None:
        """The fill of the grammar masks of this step's sampled rows (row order as `sample`'s)
        and the rows they constrain; a drafting request's row j gets the mask after its first j
        drafts (`Grammars.prepare_masks`), its matcher left on real tokens. None when there is
        nothing to mask (no grammar, or every grammar ended)."""
        jobs = []
        num_rows = 0
        for p in plan:
            if not p.samples:
                continue
            if p.state.grammar is not None:
                jobs.append((p.state.grammar, num_rows, p.drafts))
            num_rows += len(p.drafts) + 1
        if not jobs or self.grammars is None:
            return None
        return self.grammars.prepare_masks(jobs, num_rows)

    def sample(
        self,
        plan: list[Planned],
        meta: AttentionMetadata,
        hidden: torch.Tensor,
        masks: Masks | None = None,
    ) -> Drawn:
        """Sample every request whose step reaches its last known token (under its grammar's
        mask), accept drafts, advance grammars and write the tokens to the sampled buffer and
        the token buffer; moves each request's position past what it gained."""
        index: list[int] = []  # hidden-state row of every sampled position
        row_params: list[DrawParams] = []
        positions: list[int] = []
        histories: list[RowHistory] = []  # where each row's past lies in the token buffer
        sampling: Sampling = []
        for i, (p, end) in enumerate(zip(plan, meta.query_start_loc[1:], strict=True)):
            if not p.samples:  # a prefill chunk that does not reach the end of the prompt
                p.state.position = p.start + p.num_real
                continue
            sampling.append((p, len(index), i))
            for j in range(len(p.drafts) + 1):
                index.append(end - len(p.drafts) - 1 + j)
                row_params.append(p.state.params)
                positions.append(p.start + p.num_real + j)
                if p.state.params.adjusts_logits:  # drafts 0..j-1 are in the buffer before it
                    histories.append(
                        RowHistory(p.state.row, p.state.num_prompt_tokens, positions[-1])
                    )
                else:
                    histories.append(NO_HISTORY)
        if not index:
            return Drawn(None)
        logits = self.model.compute_logits(hidden, self._index(index))  # [rows, vocab]
        if masks is not None:  # before the sampler: raw logprobs see the mask too, as vLLM's
            apply_mask(logits, on_device(masks[0], self.torch_device), masks[1])
        batch = SamplingBatch.from_params(
            row_params, positions, logits.shape[-1], device=self.torch_device
        )
        banned = _banned_before_min_tokens(sampling)
        adjust = Adjustments.build(row_params, histories, logits.shape[-1], self.state.tokens)
        out = sample(  # the logits are the sampler's: a ban goes in place
            logits,
            batch,
            self.generator,
            banned=banned,
            adjust=adjust,
            logprobs_mode=self.logprobs_mode,
            consume=True,
        )
        drawn = Drawn(None)
        if self.state.track_tokens:
            counts = self._accept_drafts(sampling, out.token_ids, drawn)
        else:  # one token per sampling request, left on the device
            counts = [1] * len(sampling)
            self._write_one_each(sampling, out.token_ids)
        spans = [  # rows of requests asking for logprobs
            (p.req_id, first, n, p.state.params.logprobs, 0)
            for (p, first, _), n in zip(sampling, counts, strict=True)
            if p.state.params.logprobs is not None
        ]
        if spans:
            assert out.sampled_logprobs is not None and out.top_logprobs is not None
            assert out.top_token_ids is not None
            drawn.logprobs = LogprobRows(
                out.sampled_logprobs, out.top_logprobs, out.top_token_ids, spans
            )
        return drawn

    def _write_one_each(self, sampling: Sampling, token_ids: torch.Tensor) -> None:
        """Without drafts: each request's one token to its sampled row and the token buffer,
        read back only when a grammar must advance on it."""
        out_rows = self._index([i for _, _, i in sampling])
        self.sampled[:, 0].index_copy_(0, out_rows, token_ids)
        self.state.scatter(
            [p.state.row for p, _, _ in sampling],
            [p.state.num_tokens for p, _, _ in sampling],
            token_ids,
        )
        for p, _, _ in sampling:
            p.state.num_tokens += 1
            p.state.position = p.state.num_tokens - 1
        if any(p.state.grammar for p, _, _ in sampling):  # the op's one read, without drafts
            self._advance_grammars(sampling, token_ids)

    def _accept_drafts(
        self, sampling: Sampling, token_ids: torch.Tensor, drawn: Drawn
    ) -> list[int]:
        """Accept each request's drafts while the target agrees, plus one token; returns how
        many tokens each request gained. Reads the sampled tokens back to the host: the next
        drafts are proposed on them (the one wait inside an op, only with drafts on)."""
        tokens = token_ids.tolist()
        counts: list[int] = []
        new_rows: list[int] = []
        new_ids: list[list[int]] = []
        for p, first, i in sampling:
            accepted = 0  # drafts are deterministic: accept while the target agrees
            while accepted < len(p.drafts) and tokens[first + accepted] == p.drafts[accepted]:
                accepted += 1
            new = tokens[first : first + accepted + 1]
            drawn.num_draft_tokens += len(p.drafts)
            drawn.num_accepted_tokens += accepted
            st = p.state
            assert st.token_ids is not None
            del st.token_ids[st.num_tokens :]
            st.token_ids.extend(new)
            st.num_tokens = len(st.token_ids)
            st.position = st.num_tokens - 1
            if st.grammar is not None:  # accepted tokens only: rejected drafts never reach it
                st.grammar.accept_free(new)
            counts.append(len(new))
            new_rows.append(i)
            new_ids.append(new + [-1] * (self.sampled.shape[1] - len(new)))
        out_rows = self._index(new_rows)
        values = on_device(torch.tensor(new_ids, dtype=torch.int64), self.torch_device)
        self.sampled.index_copy_(0, out_rows, values)
        buf = [(p.state.row, p.state.num_tokens - n, n) for (p, _, _), n in zip(sampling, counts)]
        rows = [r for r, _, n in buf for _ in range(n)]
        pos = [q for _, q0, n in buf for q in range(q0, q0 + n)]
        flat = [t for seq, (_, _, n) in zip(new_ids, buf, strict=True) for t in seq[:n]]
        self.state.scatter(rows, pos, self._index(flat))
        return counts

    @staticmethod
    def _advance_grammars(sampling: Sampling, tokens: torch.Tensor) -> None:
        """Advance each grammar request's matcher by the token it drew (read back to the host:
        on cuda the op waits for the sampler here, and the next step's mask needs it)."""
        rows = [(p.state.grammar, first) for p, first, _ in sampling if p.state.grammar]
        drawn = tokens.tolist()
        for matcher, first in rows:
            assert matcher is not None
            matcher.accept_free([drawn[first]])

    def _index(self, values: list[int]) -> torch.Tensor:
        return host_index(values, self.torch_device)


def _banned_before_min_tokens(sampling: Sampling) -> tuple[list[int], list[int]]:
    """(rows, token ids): EOS and stop tokens cannot be sampled before `min_tokens` outputs."""
    rows: list[int] = []
    cols: list[int] = []
    for p, first, _ in sampling:
        st = p.state
        num_out = st.num_tokens - st.num_prompt_tokens
        if not st.eos_ids or num_out >= st.min_tokens:
            continue
        for j in range(min(len(p.drafts) + 1, st.min_tokens - num_out)):
            rows += [first + j] * len(st.eos_ids)
            cols += st.eos_ids
    return rows, cols

"""What changes a batch's logits before the draw, in vLLM's order: allowed token ids, bad words,
logit bias, then the repetition, frequency and presence penalties (the sampler bans EOS before
`min_tokens` between the bad words and the bias; a ban is -inf whatever follows).

Built once per step by `Adjustments.build` from each row's `DrawParams` and the token buffer the
device holds (prompt, every sampled token, the step's drafts), so the counts are those of the
tokens before each row's position: exact under async scheduling (a forward runs after the one
that sampled the previous token), after rejected drafts (the buffer is overwritten from the
device's own count) and after preemption (a resumed request's outputs come back with its
prompt). Each part covers only the rows that use it, and a batch where no row adjusts builds
nothing. Every operation is per row, so a row's result never depends on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.sampling import DrawParams

# The largest adjusted logit: a repetition penalty near 0 divides a positive logit towards +inf
# (NaN probabilities, a draw outside the vocabulary); below this, dividing by the smallest
# temperature the sampler draws at stays finite.
F32 = torch.finfo(torch.float32)
LOGIT_LIMIT = F32.max * 1e-6


@dataclass(frozen=True, slots=True)
class RowHistory:
    """Where a sampled row's tokens lie in the token buffer: its buffer row, how many prompt
    tokens it has, and the position of the token it samples (tokens before it are its past)."""

    buffer_row: int
    num_prompt_tokens: int
    position: int


@dataclass(frozen=True, slots=True)
class Penalties:
    rows: torch.Tensor  # [p] int64, batch rows with a penalty
    presence: torch.Tensor  # [p, 1] float32
    frequency: torch.Tensor  # [p, 1] float32
    repetition: torch.Tensor  # [p, 1] float32
    counts: torch.Tensor  # [p, vocab] float32: each token's count among the row's outputs
    seen: torch.Tensor | None  # [p, vocab] bool: in prompt or outputs; None: no repetition


@dataclass(frozen=True, slots=True)
class Adjustments:
    """Per-row logit changes of one step; `apply` writes them into a batch's logits."""

    allowed: tuple[torch.Tensor, torch.Tensor] | None  # rows [a], keep mask [a, vocab] bool
    bad_words: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, cols, 0 or -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, cols, values [c]
    penalties: Penalties | None

    @classmethod
    def build(
        cls,
        params: Sequence[DrawParams],
        histories: Sequence[RowHistory],
        vocab_size: int,
        tokens: torch.Tensor,
    ) -> Adjustments | None:
        """The adjustments of a batch whose row i has `params[i]` and `histories[i]`, reading
        past tokens from `tokens` [buffer rows, width] int64 (on the logits' device, written by
        earlier ops of the same stream); None when no row adjusts its logits."""
        if not any(p.adjusts_logits for p in params):
            return None
        device = tokens.device
        allowed = _allowed(params, vocab_size, device)
        bad_words = _bad_words(params, histories, tokens)
        bias_rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
        bias = None
        if bias_rows:
            cols = [t for p in params for t, _ in p.logit_bias]
            vals = [b for p in params for _, b in p.logit_bias]
            bias = (
                _index(bias_rows, device),
                _index(cols, device),
                torch.tensor(vals, dtype=torch.float32).to(device, non_blocking=True),
            )
        return cls(allowed, bad_words, bias, _penalties(params, histories, vocab_size, tokens))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Write the adjustments into `logits` [n, vocab] float32 in place; returns it."""
        if self.allowed is not None:
            rows, keep = self.allowed
            logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
        for part in (self.bad_words, self.bias):
            if part is not None:
                rows, cols, values = part
                logits.index_put_((rows, cols), values, accumulate=True)
        p = self.penalties
        if p is not None:
            x = logits[p.rows]  # [p, vocab]
            if p.seen is not None:  # divide positive logits, multiply the others
                scaled = torch.where(x > 0, x / p.repetition, x * p.repetition)
                x = torch.where(p.seen, scaled, x)
            x = x - p.frequency * p.counts - p.presence * (p.counts > 0)
            logits[p.rows] = x.clamp_(max=LOGIT_LIMIT)  # -inf (a ban) stays
        return logits


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _allowed(
    params: Sequence[DrawParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    at = [(j, t) for j, i in enumerate(rows) for t in params[i].allowed_token_ids or ()]
    keep = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    keep[_index([j for j, _ in at], device), _index([t for _, t in at], device)] = True
    return _index(rows, device), keep


def _bad_words(
    params: Sequence[DrawParams], histories: Sequence[RowHistory], tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Rows and token ids banned by a bad word: its last id, where its other ids are the row's
    last output tokens (vLLM matches outputs only). The prefixes are compared on the device:
    the host does not know the tokens sampled by steps still in flight."""
    single_rows: list[int] = []
    single_cols: list[int] = []
    pair_rows: list[int] = []  # one entry per (row, bad word with a prefix)
    pair_cols: list[int] = []
    where: list[int] = []  # flat buffer index of each prefix token, pairs padded to `longest`
    expect: list[int] = []
    longest = max((len(w) - 1 for p in params for w in p.bad_words_token_ids), default=0)
    width = tokens.shape[1]
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        num_out = h.position - h.num_prompt_tokens
        for word in p.bad_words_token_ids:
            k = len(word) - 1
            if k == 0:
                single_rows.append(i)
                single_cols.append(word[-1])
            elif k <= num_out:
                pair_rows.append(i)
                pair_cols.append(word[-1])
                base = h.buffer_row * width + h.position - k
                where += [base + j for j in range(k)] + [base] * (longest - k)
                expect += list(word[:-1]) + [-1] * (longest - k)  # -1: padding, always equal
    if not single_rows and not pair_rows:
        return None
    device = tokens.device
    minus_inf = torch.full((len(single_rows),), float("-inf"), device=device)
    if not pair_rows:
        return _index(single_rows, device), _index(single_cols, device), minus_inf
    got = tokens.view(-1).index_select(0, _index(where, device)).view(len(pair_rows), longest)
    want = _index(expect, device).view(len(pair_rows), longest)
    hit = ((got == want) | (want < 0)).all(dim=1)  # [pairs]
    # added with accumulate: -inf where the prefix matched, 0 elsewhere (no read-back of `hit`)
    bans = torch.where(hit, float("-inf"), 0.0)
    return (
        _index(single_rows + pair_rows, device),
        _index(single_cols + pair_cols, device),
        torch.cat([minus_inf, bans]),
    )


def _penalties(
    params: Sequence[DrawParams],
    histories: Sequence[RowHistory],
    vocab_size: int,
    tokens: torch.Tensor,
) -> Penalties | None:
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return None
    device = tokens.device
    width = tokens.shape[1]
    hist = [histories[i] for i in rows]
    # outputs: positions [num_prompt, position) of each row's buffer row
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    _count(counts, tokens, width, [(h.buffer_row, h.num_prompt_tokens, h.position) for h in hist])
    # within float32's positive range: a penalty that rounds to 0 or inf would make -inf × 0 or
    # 0 × inf (NaN) of a banned token or a zero logit
    repeat = [min(max(params[i].repetition_penalty, F32.tiny), F32.max) for i in rows]
    seen = None
    if any(r != 1.0 for r in repeat):
        prompt = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
        spans = [(h.buffer_row, 0, h.num_prompt_tokens) for h in hist]
        _count(prompt, tokens, width, spans)
        seen = (prompt > 0) | (counts > 0)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)[:, None]

    return Penalties(
        rows=_index(rows, device),
        presence=column([params[i].presence_penalty for i in rows]),
        frequency=column([params[i].frequency_penalty for i in rows]),
        repetition=column(repeat),
        counts=counts,
        seen=seen,
    )


def _count(
    out: torch.Tensor, tokens: torch.Tensor, width: int, spans: list[tuple[int, int, int]]
) -> None:
    """Add to `out[j, t]` the occurrences of token t in buffer row r at positions [lo, hi), for
    each span j = (r, lo, hi). The indices are built on the device from per-span starts and
    lengths, so the host does O(spans) work whatever the lengths."""
    lengths = [max(hi - lo, 0) for _, lo, hi in spans]
    total = sum(lengths)
    if not total:
        return
    device = tokens.device
    length_t = _index(lengths, device)
    span_of = torch.repeat_interleave(torch.arange(len(spans), device=device), length_t)
    starts = _index([r * width + lo for r, lo, _ in spans], device)
    first = torch.cumsum(length_t, 0) - length_t  # each span's first slot in the flat list
    offset = torch.arange(total, device=device) - first[span_of]
    ids = tokens.view(-1).index_select(0, starts[span_of] + offset)
    vocab = out.shape[1]
    ones = torch.ones(total, dtype=out.dtype, device=device)
    out.view(-1).index_add_(0, span_of * vocab + ids, ones)

"""Token sampling for a batch of requests with different parameters: greedy, temperature, top-k,
top-p, min-p, per-request seeds, after the penalties, bias and bans of `adjust.py`; logprobs of
the raw distribution (or, as vLLM's `logprobs_mode`, of the logits or of what the draw used).
Stateless: a seeded request's draw at position p depends only on (seed, p), so batch makeup,
preemption and async depth never change its tokens. A request's parameters are
`kvtier.sampling.DrawParams`; stop strings live in `detokenizer.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.model import native
from kvtier.model.adjust import Adjustments
from kvtier.sampling import LOGPROBS_MODES, DrawParams

GREEDY_EPS = 1e-5  # temperatures below this mean greedy (as vLLM)
CANDIDATES = 256  # rows whose top-k lies within: filtered on their best tokens, not a full sort
# logits dtypes whose float32 copy is exact (the same order, so the same argmax): a greedy batch
# without logprobs skips the copy, which at a large batch and vocabulary costs more than the
# argmax itself. A min_tokens ban then goes into a copy of the narrow logits, or in place where
# the caller hands them over (`sample`'s consume), so no wide copy is made for it either
WIDENS_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SamplingBatch:
    """Row-wise parameters as tensors, built once per step by `from_params`."""

    temperature: torch.Tensor  # [n] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [n] bool
    top_k: torch.Tensor | None  # [n] int64, vocab size where off; None if no row uses it
    top_p: torch.Tensor | None  # [n] float32
    min_p: torch.Tensor | None  # [n] float32
    seeds: tuple[int | None, ...]
    positions: tuple[int, ...]  # position of each row's sampled token (seeds the draw)
    num_logprobs: tuple[int | None, ...]
    all_greedy: bool
    any_greedy: bool
    sorts_whole: bool  # a filtered row's top-k set may reach past CANDIDATES (host-known)

    @classmethod
    def from_params(
        cls,
        params: Sequence[DrawParams],
        positions: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        greedy = [p.temperature < GREEDY_EPS for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        # top_k ≥ vocab keeps every token: clamp, so any integer fits the int64 tensor
        ks = [
            min(p.top_k, vocab_size) if p.top_k > 0 and not g else vocab_size
            for p, g in zip(params, greedy)
        ]
        ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        mins = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor(ks, device=device)
            if min(ks, default=vocab_size) < vocab_size
            else None,
            top_p=torch.tensor(ps, device=device) if min(ps, default=1.0) < 1.0 else None,
            min_p=torch.tensor(mins, device=device) if max(mins, default=0.0) > 0.0 else None,
            seeds=tuple(p.seed for p in params),
            positions=tuple(positions),
            num_logprobs=tuple(p.logprobs for p in params),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            sorts_whole=any(k > CANDIDATES and (k < vocab_size or p < 1.0) for k, p in zip(ks, ps)),
        )


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [n] int64
    sampled_logprobs: torch.Tensor | None  # [n] float32, of the distribution logprobs_mode names
    top_logprobs: torch.Tensor | None  # [n, k] float32, k = largest request; rows trim to theirs
    top_token_ids: torch.Tensor | None  # [n, k] int64


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    generator: torch.Generator | None = None,
    *,
    banned: tuple[list[int], list[int]] | None = None,
    adjust: Adjustments | None = None,
    logprobs_mode: str = "raw_logprobs",
    consume: bool = False,
) -> SamplerOutput:
    """logits [n, vocab] → one token per row; `generator` draws for rows without a seed.

    `banned` (rows, token ids) can never be drawn (e.g. EOS before min_tokens); `adjust` (allowed
    ids, bad words, logit bias, penalties: `model/adjust.py`) applies after the ban, and a row it
    leaves nothing to draw keeps its logits unadjusted (it never draws outside the vocabulary).
    Logprobs, for batches where a row asked, follow `logprobs_mode` (one of LOGPROBS_MODES): raw
    ones are taken from `logits` as given, before the ban, adjustments, temperature and filters.
    With `consume` the caller hands `logits` over (it reads them no more): a ban's -inf and the
    temperature's division go into them in place instead of into copies of the whole batch (0.5B
    shape at batch 64: 64 × 32,000 logits a step).
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    wanted = any(n is not None for n in batch.num_logprobs)
    given = logits
    if not (batch.all_greedy and not wanted and logits.dtype in WIDENS_EXACTLY):
        logits = logits.float()  # a greedy batch without logprobs argmaxes the logits as given
    report = None  # [n, vocab] what logprobs are read from
    if wanted and logprobs_mode == "raw_logprobs":
        report = torch.log_softmax(logits, dim=-1)
    elif wanted and logprobs_mode == "raw_logits":
        report = logits
    if banned is not None and banned[0]:
        where = tuple(
            torch.tensor(b, dtype=torch.int64).to(logits.device, non_blocking=True) for b in banned
        )
        minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype)
        owned = _owned(logits, given, report, consume)
        logits = (
            logits.index_put_(where, minus_inf) if owned else logits.index_put(where, minus_inf)
        )
    if adjust is not None:
        adjusted = adjust.apply(logits.float().clone())
        dead = torch.isneginf(adjusted.amax(dim=-1, keepdim=True))  # [n, 1]: nothing left
        logits = torch.where(dead, logits.float(), adjusted)
    if batch.all_greedy:
        tokens = native.argmax(logits)
        processed = logits
    else:
        # in place where allowed: a new [n, vocab] tensor costs its page faults
        owned = _owned(logits, given, report, consume)
        processed = processed_logits(logits, batch, in_place=owned)
        tokens = _draw(processed, _uniforms(batch, generator, logits.device))
        if batch.any_greedy:
            tokens = torch.where(batch.greedy, native.argmax(logits), tokens)
    if not wanted:
        return SamplerOutput(tokens, None, None, None)
    if report is None and logprobs_mode == "processed_logits":
        report = processed
    elif report is None:
        report = torch.log_softmax(processed, dim=-1)  # only now: logprobs are wanted
    k = max(n for n in batch.num_logprobs if n is not None)
    return SamplerOutput(tokens, *gather_logprobs(report, tokens, k))


def _owned(
    logits: torch.Tensor, given: torch.Tensor, report: torch.Tensor | None, consume: bool
) -> bool:
    """Whether `sample` may write into `logits`: nobody reads their values after it. The
    caller's tensor (`given`) only if handed over, and never the one raw logits are reported
    from."""
    return (consume or logits is not given) and report is not logits


def gather_logprobs(
    values: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [n, vocab] → (each row's value at token_ids [n], top-k values [n, k], their ids)."""
    chosen = values.gather(1, token_ids[:, None])[:, 0]
    k = min(k, values.shape[-1])
    if not k:
        return chosen, values[:, :0], token_ids[:, None][:, :0]
    top = values.topk(k, dim=-1)
    return chosen, top.values, top.indices


def processed_logits(
    logits: torch.Tensor, batch: SamplingBatch, *, in_place: bool = False
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filters (filtered logits become -inf); with
    `in_place` the temperature divides `logits` itself (greedy rows, at 1.0, keep their values)."""
    t = batch.temperature[:, None]  # greedy rows carry temperature 1.0
    x = logits.div_(t) if in_place else logits / t
    if batch.top_k is not None or batch.top_p is not None:
        filtered = native.top_k_top_p_(x, batch.top_k, batch.top_p)  # x is ours: in place
        if filtered is not None:
            x = filtered
        elif batch.top_k is None or batch.sorts_whole or x.shape[-1] <= CANDIDATES:
            x = _sorted_filter(x, batch.top_k, batch.top_p)
        else:
            x = _top_k_top_p(x, batch.top_k, batch.top_p)
    if batch.min_p is not None:  # p ≥ min_p · p_max ⇔ x ≥ max(x) + ln(min_p): no softmax
        floor = x.amax(dim=-1, keepdim=True) + torch.log(batch.min_p[:, None])  # -inf at 0
        x = x.masked_fill_(x < floor, float("-inf"))  # x is ours (the division made or owns it)
    return x


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k and top-p where every filtered row's top-k set lies within its best `CANDIDATES`
    tokens (the caller knows from the parameters): those are taken with `topk`, not a sort of
    the whole vocabulary (the costliest part of sampling otherwise), and cut as `_sorted_filter`
    cuts. The
    same kept sets. Rows without top-k (and so without top-p) keep every token. No value is read
    on the host."""
    sorted_x, order = x.topk(CANDIDATES, dim=-1)  # [n, CANDIDATES], descending
    drop = _cut(sorted_x, top_k, top_p)
    kept = torch.full_like(x, float("-inf")).scatter(
        1, order, sorted_x.masked_fill(drop, float("-inf"))
    )
    return torch.where((top_k >= x.shape[-1])[:, None], x, kept)


def _sorted_filter(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k and top-p over each row sorted whole."""
    sorted_x, order = x.sort(dim=-1, descending=True)  # [n, vocab]
    drop = _cut(sorted_x, top_k, top_p)
    return x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def _cut(
    sorted_x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Which of each row's best tokens (descending) top-k and top-p drop; never the first."""
    drop = torch.zeros_like(sorted_x, dtype=torch.bool)
    if top_k is not None:
        rank = torch.arange(sorted_x.shape[-1], device=sorted_x.device)[None, :]
        drop |= rank >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # rows at 1.0 keep all
    drop[:, 0] = False
    return drop


def _draw(processed: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token for its uniform: the native inverse CDF on the host, else torch's. A row
    without a distribution (a NaN or +inf, or only -inf) draws its argmax either way."""
    tokens = native.draw(processed, u)
    if tokens is not None:
        return tokens
    # softmax, not exp(log_softmax): torch's exp is slow on -inf, and after top-p most of a
    # row's tokens are -inf
    tokens = _inverse_cdf(torch.softmax(processed, dim=-1), u)  # [n, vocab]; 0 where filtered
    # a NaN softmax reaches no target: the search answers the vocabulary's size
    return torch.where(tokens < processed.shape[-1], tokens, processed.argmax(dim=-1))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token where its cumulative probability first reaches u (0, 1] of the row's
    mass: filtered tokens (probability 0) leave the sum flat, so they are never reached. One
    uniform a row instead of an exponential per token: a draw per vocabulary entry would cost
    more than the rest of the sampling, and a cumulative sum and a search are cheap."""
    cdf = probs.cumsum(dim=-1)  # non-decreasing; its last entry is the row's mass
    target = u[:, None] * cdf[:, -1:]  # in (0, mass]: some entry reaches it
    return torch.searchsorted(cdf, target)[:, 0]  # first entry ≥ target


def _uniforms(
    batch: SamplingBatch, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """[n] uniforms in (0, 1]: seeded rows from (seed, position) alone, others from `generator`."""
    u = 1.0 - torch.rand(len(batch.seeds), generator=generator, device=device)  # [0, 1) → (0, 1]
    seeded = [(row, seed) for row, seed in enumerate(batch.seeds) if seed is not None]
    if seeded:
        rows = [row for row, _ in seeded]
        values = [seeded_uniform(seed, batch.positions[row]) for row, seed in seeded]
        index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        u[index] = torch.tensor(values, dtype=u.dtype).to(device, non_blocking=True)
    return u


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit words whose every output bit depends on
    every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in (0, 1] a row seeded `seed` draws at `position`: a hash of the two, the same
    on every device and in every batch. A torch generator seeded per row cost two calls a row
    (a kernel launch each on a GPU), more than the rest of a step's draw."""
    z = _mix64((_mix64(seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64)
    return ((z >> 11) + 1) / float(1 << 53)

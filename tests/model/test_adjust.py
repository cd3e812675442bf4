"""Penalties, logit bias, bad words and allowed token ids (`model/adjust.py`) against a plain
per-row reference of vLLM's semantics on random batches; their effect through `sample`."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.model import native
from kvtier.model.adjust import Adjustments, RowHistory
from kvtier.model.sampler import SamplingBatch, sample
from kvtier.sampling import DrawParams

VOCAB = 12
WIDTH = 40  # token buffer positions per row


def reference(
    row: torch.Tensor, p: DrawParams, prompt: list[int], out: list[int], vocab: int = VOCAB
) -> None:
    """One row, as vLLM's sampler writes it, token by token: allowed ids, bad words (matched
    against the outputs), logit bias, repetition (prompt and outputs), frequency, presence;
    float32 arithmetic in the engine's order."""
    if p.allowed_token_ids is not None:
        for t in range(vocab):
            if t not in p.allowed_token_ids:
                row[t] = float("-inf")
    for word in p.bad_words_token_ids:
        prefix = list(word[:-1])
        if len(prefix) <= len(out) and (not prefix or out[-len(prefix) :] == prefix):
            row[word[-1]] = float("-inf")
    for t, b in p.logit_bias:
        row[t] += b
    seen = set(prompt) | set(out)
    for t in range(vocab):
        x = row[t : t + 1]
        if p.repetition_penalty != 1.0 and t in seen:
            r = torch.tensor([p.repetition_penalty])
            x = x / r if x.item() > 0 else x * r
        n = torch.tensor([float(out.count(t))])
        x = x - torch.tensor([p.frequency_penalty]) * n
        row[t] = (x - torch.tensor([p.presence_penalty]) * (n > 0))[0]


def random_params(rng: random.Random) -> DrawParams:
    kinds = rng.sample(["presence", "frequency", "repetition", "bias", "allowed", "bad"], 3)
    kw: dict[str, object] = {}
    if "presence" in kinds:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if "frequency" in kinds:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if "repetition" in kinds:
        kw["repetition_penalty"] = rng.uniform(0.5, 2)
    if "bias" in kinds:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)}
    if "allowed" in kinds:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), 6)
    if "bad" in kinds:
        kw["bad_words_token_ids"] = [
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))] for _ in range(3)
        ]
    return DrawParams(**kw) if rng.random() < 0.8 else DrawParams()  # some rows adjust nothing


@pytest.mark.parametrize("seed", range(8))
def test_adjustments_equal_the_per_row_reference_on_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    n = 7
    tokens = torch.randint(0, 3, (n + 2, WIDTH), generator=torch.Generator().manual_seed(seed))
    params = [random_params(rng) for _ in range(n)]
    histories = []
    for i in range(n):
        num_prompt = rng.randint(1, 10)
        histories.append(RowHistory(i + 2, num_prompt, num_prompt + rng.randint(0, 20)))
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed + 100)) * 3
    adjust = Adjustments.build(params, histories, VOCAB, tokens)
    assert adjust is not None
    got = adjust.apply(logits.clone())
    want = logits.clone()
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        past = tokens[h.buffer_row].tolist()
        reference(want[i], p, past[: h.num_prompt_tokens], past[h.num_prompt_tokens : h.position])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_a_batch_without_adjustments_builds_nothing() -> None:
    params = [DrawParams(temperature=0.5), DrawParams(repetition_penalty=1.0)]
    histories = [RowHistory(0, 1, 2)] * 2
    assert Adjustments.build(params, histories, VOCAB, torch.zeros(2, 4, dtype=torch.int64)) is None


def test_the_penalties_count_the_drafts_before_each_row() -> None:
    """Rows j of one request's verification step see its drafts 0..j-1 as outputs."""
    tokens = torch.tensor([[1, 2, 5, 5, 7, 0, 0, 0]])  # prompt [1, 2], outputs [5], drafts [5, 7]
    p = DrawParams(frequency_penalty=1.0)
    histories = [RowHistory(0, 2, 3 + j) for j in range(3)]
    adjust = Adjustments.build([p] * 3, histories, 8, tokens)
    assert adjust is not None
    got = adjust.apply(torch.zeros(3, 8))
    assert got[:, 5].tolist() == [-1.0, -2.0, -2.0]
    assert got[:, 7].tolist() == [0.0, 0.0, -1.0]
    assert got[:, 1].tolist() == [0.0] * 3  # prompt tokens carry no frequency penalty


def draw(logits: torch.Tensor, params: list[DrawParams], tokens: torch.Tensor, **kw):
    n = len(params)
    histories = [RowHistory(i, 1, 1) for i in range(n)]
    batch = SamplingBatch.from_params(params, [1] * n, logits.shape[-1])
    adjust = Adjustments.build(params, histories, logits.shape[-1], tokens)
    return sample(logits, batch, torch.Generator().manual_seed(0), adjust=adjust, **kw)


def test_a_bias_of_100_forces_the_token_and_minus_100_bans_it() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 4
    tokens = torch.zeros(64, 4, dtype=torch.int64)
    forced = [DrawParams(temperature=t, logit_bias={17: 100}) for t in (0.0, 1.0) * 32]
    assert draw(logits, forced, tokens).token_ids.tolist() == [17] * 64
    best = logits.argmax(-1)
    banned = [DrawParams(temperature=0.0, logit_bias={int(b): -100}) for b in best]
    assert (draw(logits, banned, tokens).token_ids != best).all()
    hot = [DrawParams(temperature=1.0, logit_bias={int(b): -100}) for b in best]
    for seed in range(5):
        params = [
            DrawParams(temperature=1.0, seed=seed, logit_bias=dict(p.logit_bias)) for p in hot
        ]
        assert (draw(logits, params, tokens).token_ids != best).all()


def test_raw_logprobs_are_before_the_adjustments_processed_after() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(2))
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    params = [DrawParams(temperature=0.0, logprobs=1, logit_bias={3: 100})] * 2
    raw = draw(logits, params, tokens)
    assert raw.token_ids.tolist() == [3, 3]
    want = torch.log_softmax(logits, -1)[:, 3]
    torch.testing.assert_close(raw.sampled_logprobs, want)
    processed = draw(logits, params, tokens, logprobs_mode="processed_logprobs")
    assert processed.sampled_logprobs is not None
    assert processed.sampled_logprobs.tolist() == pytest.approx([0.0, 0.0], abs=1e-6)


def test_a_row_left_with_nothing_to_draw_keeps_its_logits_and_stays_in_the_vocabulary() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(3))
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    params = [
        DrawParams(temperature=1.0, allowed_token_ids=[4], bad_words_token_ids=[[4]]),
        DrawParams(temperature=0.0, allowed_token_ids=[4]),
    ]
    out = draw(logits, params, tokens).token_ids.tolist()
    assert 0 <= out[0] < 10 and out[1] == 4


def test_a_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    tokens = torch.tensor([[9, 1, 2, 0], [9, 1, 3, 0], [1, 2, 0, 0]])  # prompt: 1 token
    p = DrawParams(temperature=0.0, bad_words_token_ids=[[1, 2, 6]])
    # row 0: outputs [1, 2] → 6 banned; row 1: [1, 3] → not; row 2: outputs [2] only: the prefix
    # [1, 2] reaches into the prompt, which vLLM never matches
    histories = [RowHistory(0, 1, 3), RowHistory(1, 1, 3), RowHistory(2, 1, 2)]
    adjust = Adjustments.build([p] * 3, histories, 8, tokens)
    assert adjust is not None
    got = adjust.apply(torch.zeros(3, 8))
    assert got[:, 6].tolist() == [float("-inf"), 0.0, 0.0]
    assert torch.isfinite(got[:, :6]).all()


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "torch"])
def test_adjusted_rows_draw_the_same_on_the_native_and_torch_paths(kernel, monkeypatch) -> None:
    """The native argmax and top-k / top-p filter read the adjusted logits, as torch's do."""
    if not kernel:
        monkeypatch.setattr(native, "top_k_top_p_", lambda x, k, p: None)
        monkeypatch.setattr(native, "argmax", lambda x: x.argmax(dim=-1))
    elif native.kernels() is None:
        pytest.skip("no native kernels on this machine")
    rng = random.Random(5)
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(5)) * 3
    tokens = torch.randint(0, 300, (32, 40), generator=torch.Generator().manual_seed(6))
    params = []
    for i in range(32):
        kw = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.4}
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.9, "seed": i, "top_k": 20}
        params.append(DrawParams(**kw, **sampling, top_p=0.9 if i % 4 == 0 else 1.0))
    histories = [RowHistory(i, rng.randint(1, 10), 30) for i in range(32)]
    batch = SamplingBatch.from_params(params, [30] * 32, 300)
    adjust = Adjustments.build(params, histories, 300, tokens)
    got = sample(logits, batch, torch.Generator().manual_seed(0), adjust=adjust).token_ids
    want = adjust.apply(logits.clone()) if adjust is not None else logits
    assert got[1::2].tolist() == want[1::2].argmax(-1).tolist()
    monkeypatch.undo()  # the default path (native where built) draws the same tokens
    plain = sample(logits, batch, torch.Generator().manual_seed(0), adjust=adjust).token_ids
    assert torch.equal(got, plain)


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-30, 1e30, 1e300])
def test_extreme_repetition_penalties_never_draw_outside_the_vocabulary(penalty: float) -> None:
    """A repetition penalty near 0 divides positive logits to +inf (softmax: NaN) unless the
    adjusted logits are bounded; found by the HTTP fuzz taking the engine down."""
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(7)) * 3
    logits[:, :10] = 0.0  # 0 × an infinite penalty is NaN
    tokens = torch.randint(0, 50, (16, 20), generator=torch.Generator().manual_seed(8))
    params = [
        DrawParams(
            temperature=t,
            seed=i,
            repetition_penalty=penalty,
            top_p=p,
            allowed_token_ids=[tokens[i, 0].item(), 3] if i % 3 == 0 else None,  # -inf × 0 too
        )
        for i, (t, p) in enumerate([(1.0, 1.0), (1e-4, 1.0), (0.7, 0.5), (0.0, 1.0)] * 4)
    ]
    histories = [RowHistory(i, 10, 20) for i in range(16)]
    for seed in range(4):
        params = [DrawParams(**{**vars_of(p), "seed": seed}) for p in params]
        out = draw_with(logits, params, histories, tokens)
        assert ((out >= 0) & (out < 50)).all(), out
        for i, p in enumerate(params):
            assert p.allowed_token_ids is None or out[i].item() in p.allowed_token_ids


def vars_of(p: DrawParams) -> dict[str, object]:
    return {f: getattr(p, f) for f in DrawParams.__dataclass_fields__}


def draw_with(logits, params, histories, tokens) -> torch.Tensor:
    batch = SamplingBatch.from_params(params, [h.position for h in histories], logits.shape[-1])
    adjust = Adjustments.build(params, histories, logits.shape[-1], tokens)
    return sample(logits, batch, torch.Generator().manual_seed(0), adjust=adjust).token_ids

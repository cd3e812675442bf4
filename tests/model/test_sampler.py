"""Sampler: greedy is argmax; top-k / top-p / min-p keep exactly their sets; temperature sampling
follows the softmax; seeds are deterministic per (seed, position) and batch-independent; logprobs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtier.model import native
from kvtier.model.sampler import (
    CANDIDATES,
    SamplingBatch,
    _inverse_cdf,
    _sorted_filter,
    processed_logits,
    sample,
)
from kvtier.sampling import DrawParams

VOCAB = 16


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2  # [n, V]


def draw(logits: torch.Tensor, params: list[DrawParams], positions=None, gen_seed=0):
    positions = positions if positions is not None else [0] * len(params)
    batch = SamplingBatch.from_params(params, positions, VOCAB)
    return sample(logits, batch, torch.Generator().manual_seed(gen_seed))


def test_greedy_is_argmax_and_mixes_with_random_rows():
    logits = logits_rows(6)
    params = [DrawParams(temperature=0.0), DrawParams(temperature=1.0)] * 3
    out = draw(logits, params)
    assert out.token_ids[::2].tolist() == logits[::2].argmax(-1).tolist()
    assert out.sampled_logprobs is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_rows_of_narrow_logits_pick_what_their_float32_copy_picks(dtype):
    """A greedy batch without logprobs argmaxes bfloat16 / float16 logits without the float32
    copy: the same tokens, ties (many in 8-bit mantissas) and bans included."""
    logits = (torch.randn(64, 4096, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    logits[0, [7, 4000]] = 30.0  # a tie: the first
    logits[1, 11] = logits[1].max() + 1  # the best token, banned below
    batch = SamplingBatch.from_params([DrawParams(temperature=0.0)] * 64, [0] * 64, 4096)
    banned = ([1, 5], [11, 2])
    for ban in (None, banned):
        narrow = sample(logits, batch, banned=ban).token_ids
        wide = sample(logits.float(), batch, banned=ban).token_ids
        assert torch.equal(narrow, wide)
    assert sample(logits, batch).token_ids[:2].tolist() == [7, 11]
    assert sample(logits, batch, banned=banned).token_ids[1] != 11


def test_temperature_sampling_follows_softmax():
    row = logits_rows(1)
    n = 4000
    logits = row.expand(n, VOCAB)
    out = draw(logits, [DrawParams(temperature=0.7)] * n)
    freq = torch.bincount(out.token_ids, minlength=VOCAB).float() / n
    expected = torch.softmax(row[0] / 0.7, -1)
    assert (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (DrawParams(top_k=3), lambda p: p.argsort(descending=True)[:3]),
        (DrawParams(top_p=0.6), lambda p: nucleus(p, 0.6)),
        (DrawParams(min_p=0.2), lambda p: torch.nonzero(p >= 0.2 * p.max()).flatten()),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_filters_keep_exactly_their_set(params, allowed):
    row = logits_rows(1, seed=3)
    keep = set(allowed(torch.softmax(row[0], -1)).tolist())
    assert 1 < len(keep) < VOCAB
    n = 3000
    out = draw(row.expand(n, VOCAB), [params] * n)
    assert set(out.token_ids.tolist()) == keep  # every kept token appears, nothing else
    processed = processed_logits(row, SamplingBatch.from_params([params], [0], VOCAB))[0]
    assert set(torch.nonzero(torch.isfinite(processed)).flatten().tolist()) == keep


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    order = probs.argsort(descending=True)
    mass, keep = 0.0, []
    for t in order.tolist():
        keep.append(t)
        mass += float(probs[t])
        if mass >= top_p:
            break
    return torch.tensor(keep)


def test_same_seed_same_tokens_regardless_of_batch_and_other_rows():
    logits = logits_rows(8, seed=5)
    seeded = [DrawParams(temperature=1.0, seed=s) for s in range(8)]
    a = draw(logits, seeded, positions=list(range(10, 18)), gen_seed=1).token_ids
    b = draw(logits, seeded, positions=list(range(10, 18)), gen_seed=2).token_ids
    assert a.tolist() == b.tolist()
    alone = draw(logits[3:4], seeded[3:4], positions=[13], gen_seed=9).token_ids
    assert alone.item() == a[3].item()


def test_different_seeds_and_positions_give_different_draws():
    row = logits_rows(1, seed=6).expand(64, VOCAB) * 0.1  # near-uniform: draws spread widely
    by_seed = draw(row, [DrawParams(seed=s) for s in range(64)], positions=[5] * 64)
    by_pos = draw(row, [DrawParams(seed=1)] * 64, positions=list(range(64)))
    assert len(set(by_seed.token_ids.tolist())) > 8
    assert len(set(by_pos.token_ids.tolist())) > 8


def test_unseeded_rows_follow_the_generator():
    logits = logits_rows(32, seed=8) * 0.1
    params = [DrawParams()] * 32
    assert draw(logits, params, gen_seed=1).token_ids.tolist() == (
        draw(logits, params, gen_seed=1).token_ids.tolist()
    )
    assert draw(logits, params, gen_seed=1).token_ids.tolist() != (
        draw(logits, params, gen_seed=2).token_ids.tolist()
    )


@pytest.mark.parametrize(
    "params",
    [DrawParams(top_k=2), DrawParams(top_p=0.1), DrawParams(min_p=0.5)],
    ids=["top_k", "top_p", "min_p"],
)
def test_logprobs_are_of_the_raw_distribution_whatever_the_filters(params):
    """As vLLM's default `raw_logprobs`: log_softmax of the model's logits, before temperature and
    filters, so a filtered request still gets finite logprobs for tokens it could not sample."""
    logits = logits_rows(64, seed=9)
    params = replace(params, temperature=0.7, logprobs=5)
    out = draw(logits, [params] * 64)
    raw = torch.log_softmax(logits, -1)
    assert out.sampled_logprobs is not None and out.top_logprobs is not None
    assert out.top_token_ids is not None
    assert torch.isfinite(out.sampled_logprobs).all() and torch.isfinite(out.top_logprobs).all()
    torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    top = raw.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert out.top_token_ids.tolist() == top.indices.tolist()
    batch = SamplingBatch.from_params([params], [0], VOCAB)
    kept = set(torch.nonzero(torch.isfinite(processed_logits(logits[:1], batch)[0])).tolist()[0])
    assert set(out.top_token_ids[0].tolist()) - kept  # candidates the filter removed are listed


def test_raw_logprobs_ignore_banned_tokens_the_draw_cannot_pick():
    logits = logits_rows(4, seed=2)
    best = logits.argmax(-1)
    params = [DrawParams(temperature=0.0, logprobs=1)] * 4
    batch = SamplingBatch.from_params(params, [0] * 4, VOCAB)
    out = sample(logits, batch, banned=(list(range(4)), best.tolist()))
    assert (out.token_ids != best).all()  # banned (e.g. EOS before min_tokens) never drawn
    assert out.top_token_ids is not None and out.top_token_ids[:, 0].tolist() == best.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [DrawParams(temperature=0.0), DrawParams(temperature=0.8)])
def test_a_ban_leaves_the_callers_logits_unless_handed_over(dtype, params):
    """A ban writes -inf in place only into logits the caller hands over (`consume`): the same
    tokens either way, and logits not handed over are left as they were."""
    logits = logits_rows(4, seed=4).to(dtype)
    best = logits.float().argmax(-1)
    batch = SamplingBatch.from_params([params] * 4, [0] * 4, VOCAB)
    banned = (list(range(4)), best.tolist())
    before = logits.clone()
    kept = sample(logits, batch, torch.Generator().manual_seed(1), banned=banned).token_ids
    assert torch.equal(logits, before)  # not handed over: untouched
    handed = sample(
        logits, batch, torch.Generator().manual_seed(1), banned=banned, consume=True
    ).token_ids
    assert torch.equal(kept, handed) and (handed != best).all()


def test_a_handed_over_ban_still_reports_raw_logits_unbanned():
    """`raw_logits` are reported from the logits as given, so a handed-over ban still goes to a
    copy: the banned best token keeps its raw value among the reported top logits."""
    logits = logits_rows(4, seed=5)
    best = logits.argmax(-1)
    batch = SamplingBatch.from_params([DrawParams(temperature=0.0, logprobs=1)] * 4, [0] * 4, VOCAB)
    out = sample(
        logits.clone(), batch, banned=(list(range(4)), best.tolist()),
        logprobs_mode="raw_logits", consume=True,
    )  # fmt: skip
    assert (out.token_ids != best).all()
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids[:, 0].tolist() == best.tolist()
    assert torch.equal(out.top_logprobs[:, 0], logits.max(-1).values)


def test_logprobs_modes_as_vllm():
    logits = logits_rows(3, seed=9)
    params = [
        DrawParams(temperature=0.0, logprobs=VOCAB),
        DrawParams(top_k=4, logprobs=2),
        DrawParams(temperature=0.5, logprobs=0),
    ]
    batch = SamplingBatch.from_params(params, [0] * 3, VOCAB)
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, batch, gen, logprobs_mode="processed_logprobs")
    assert out.top_logprobs is not None and out.top_token_ids is not None
    assert out.top_logprobs.shape == (3, VOCAB) and out.top_token_ids.shape == (3, VOCAB)
    torch.testing.assert_close(out.top_logprobs[0].exp().sum(), torch.tensor(1.0))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()  # sorted, best first
    assert out.top_token_ids[0, 0] == out.token_ids[0] == logits[0].argmax()
    assert torch.isinf(out.top_logprobs[1, 4:]).all()  # top-k=4 filtered the rest out
    torch.testing.assert_close(out.top_logprobs[1, :4].exp().sum(), torch.tensor(1.0))
    expected = torch.log_softmax(logits[2] / 0.5, -1)[out.token_ids[2]]
    torch.testing.assert_close(out.sampled_logprobs[2], expected)
    gen.manual_seed(0)
    same = sample(logits, batch, gen, logprobs_mode="processed_logits")
    assert same.token_ids.tolist() == out.token_ids.tolist()
    assert same.top_logprobs is not None
    torch.testing.assert_close(same.top_logprobs[2], (logits[2] / 0.5).sort(descending=True)[0])
    raw_logits = sample(logits, batch, logprobs_mode="raw_logits")
    assert raw_logits.top_logprobs is not None
    torch.testing.assert_close(raw_logits.top_logprobs[1, :2], logits[1].topk(2).values)
    with pytest.raises(ValueError, match="logprobs_mode"):
        sample(logits, batch, logprobs_mode="processed")


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"top_p": 0.0}, {"min_p": 1.5}, {"top_k": -2}, {"logprobs": -1}],
)
def test_bad_params_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DrawParams(**kwargs)


def test_rows_without_filters_keep_every_token_beside_filtered_rows():
    logits = logits_rows(2, seed=10) * 20  # very peaked: tail mass rounds to nothing
    params = [DrawParams(), DrawParams(top_p=0.5, top_k=3, min_p=0.1)]
    processed = processed_logits(logits, SamplingBatch.from_params(params, [0, 0], VOCAB))
    assert torch.isfinite(processed[0]).all()
    assert torch.isfinite(processed[1]).sum() < VOCAB


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"temperature": float("nan")}, ValueError),
        ({"temperature": float("inf")}, ValueError),
        ({"temperature": "1"}, TypeError),
        ({"top_p": float("nan")}, ValueError),
        ({"min_p": float("nan")}, ValueError),
        ({"top_k": 2.5}, TypeError),
        ({"top_k": True}, TypeError),
        ({"top_k": 10**30}, ValueError),
        ({"seed": "x"}, TypeError),
        ({"seed": 1.5}, TypeError),
        ({"seed": 2**64}, ValueError),
        ({"logprobs": 1.0}, TypeError),
    ],
)
def test_wrong_types_and_non_finite_values_raise(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        DrawParams(**kwargs)


def test_top_k_at_or_beyond_the_vocabulary_is_clamped_to_no_filter():
    """Any object with the attributes may reach the batch: a top_k past int64 beside an
    ordinary one used to overflow building the top_k tensor."""
    from types import SimpleNamespace

    huge = SimpleNamespace(**{**vars(DrawParams()).copy(), "top_k": 10**30})
    batch = SamplingBatch.from_params([huge, DrawParams(top_k=3)], [0, 0], VOCAB)
    assert batch.top_k is not None and batch.top_k.tolist() == [VOCAB, 3]
    alone = SamplingBatch.from_params([DrawParams(top_k=2**62)], [0], VOCAB)
    assert alone.top_k is None  # no row filters: no tensor at all


def test_the_draw_never_lands_on_a_filtered_token_at_the_uniform_s_extremes():
    """One uniform in (0, 1] per row against the cumulative probabilities: the first entry that
    reaches it, so zero-probability tokens (filtered, banned) before, between and after the kept
    ones are never drawn, at u = 1 and at the smallest u too."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = torch.tensor([1.0, torch.finfo(torch.float32).tiny, 0.25, 0.2500001, 0.9999999])
    assert _inverse_cdf(probs, u).tolist() == [3, 1, 1, 3, 3]


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked rows, and near-uniform ones
@pytest.mark.parametrize("whole", [False, True], ids=["candidates", "sorted-whole"])
@pytest.mark.parametrize("kernel", [True, False], ids=["native", "torch"])
def test_top_k_top_p_keep_the_sets_of_a_full_sort(scale, whole, kernel, monkeypatch):
    """On the host the native filter (no sort) runs; elsewhere batches whose filtered rows all
    have their top-k set within CANDIDATES tokens take them with `topk`, others sort whole: each
    way the kept logits are those of sorting every row, for every mix of top-k and top-p, banned
    tokens included."""
    if not kernel:
        monkeypatch.setattr(native, "top_k_top_p_", lambda x, k, p: None)
    elif native.kernels() is None:
        pytest.skip("no native kernels on this machine")
    vocab, n = 4 * CANDIDATES, 48
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(n, vocab, generator=gen) * scale
    logits[3, 100:] = float("-inf")  # banned tokens
    ps = [1.0, 0.5, 0.9, 0.999]
    ks = [0, 5, CANDIDATES + 1, vocab - 1] if whole else [0, 1, 5, CANDIDATES]
    params = [  # without `whole`, rows without top-k have no top-p either (nothing to sort)
        DrawParams(
            temperature=0.8, top_k=ks[i % 4], top_p=ps[(i // 4) % 4] if whole or ks[i % 4] else 1.0
        )
        for i in range(n)
    ]
    batch = SamplingBatch.from_params(params, [0] * n, vocab)
    assert batch.sorts_whole == whole
    ours = processed_logits(logits, batch)
    want = _sorted_filter(logits / batch.temperature[:, None], batch.top_k, batch.top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(want))
    assert torch.equal(ours[torch.isfinite(ours)], want[torch.isfinite(want)])
    assert torch.isfinite(ours).sum(-1).min() >= 1


def filter_pair(x, top_k, top_p):
    """(the native filter's result, sorting's) on copies of x; the sort in float64, so that its
    cut is not float32's rounding of a long cumulative sum (on a flat row of 32,000 tokens
    that moves a cut at top-p 0.999 by a few tokens either way)"""
    ours = native.top_k_top_p_(x.clone(), top_k, top_p)
    assert ours is not None
    want = _sorted_filter(x.double(), top_k, None if top_p is None else top_p.double())
    return ours, want


@pytest.mark.parametrize("vocab", [1, 17, 300, 32000])
@pytest.mark.parametrize("scale", [30.0, 3.0, 0.3, 0.001])  # one token … nearly uniform
def test_native_filter_keeps_the_sets_of_a_full_sort(vocab, scale):
    """The radix select keeps what sorting each row keeps: top-k alone, top-p alone, both, with
    banned (-inf) tokens, on rows of every width and spread (the reach bounds, the candidates and
    every level of the select are crossed somewhere here); kept logits unchanged, the rest -inf."""
    if native.kernels() is None:
        pytest.skip("no native kernels on this machine")
    gen = torch.Generator().manual_seed(vocab + int(scale * 1000))
    n = 12
    x = torch.randn(n, vocab, generator=gen) * scale
    x[1, : vocab // 2] = float("-inf")
    top_k = torch.tensor([1, 2, 5, 40, vocab, vocab + 9, 1, 3, 50, vocab, 7, 1000])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.95, 0.3, 0.0, 0.99, 1.0, 0.8, 0.999, 0.6, 0.9])
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        ours, want = filter_pair(x, k, p)
        kept = torch.isfinite(ours)
        assert torch.equal(kept, torch.isfinite(want)), (k, p)
        assert torch.equal(ours[kept], x[kept])
        assert kept.sum(-1).min() >= 1


def test_native_filter_breaks_ties_by_index():
    """Equal logits: as many kept as sorting keeps, and those the lowest indices (sorting's
    order among equals is its own)."""
    if native.kernels() is None:
        pytest.skip("no native kernels on this machine")
    x = torch.zeros(4, 1000)
    x[:, 700:] = 1.0  # 300 equal best tokens, then 700 equal others
    ours, want = filter_pair(
        x, torch.tensor([10, 300, 450, 1000]), torch.tensor([1.0, 1.0, 1.0, 0.5])
    )
    assert torch.equal(torch.isfinite(ours).sum(-1), torch.isfinite(want).sum(-1))
    kept = [torch.isfinite(row).nonzero()[:, 0].tolist() for row in ours]
    assert kept[0] == list(range(700, 710))
    assert kept[1] == list(range(700, 1000))
    assert kept[2] == list(range(150)) + list(range(700, 1000))
    # top-p 0.5 of mass e/(300e + 700): the best tokens alone, as many as reach half of it
    assert kept[3] == list(range(700, 700 + len(kept[3]))) and len(kept[3]) < 300


def test_native_filter_leaves_rows_it_cannot_order():
    """A row with a NaN, or with every token banned, stays as it is; +inf keeps top-k only
    (no softmax of it exists)."""
    if native.kernels() is None:
        pytest.skip("no native kernels on this machine")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    x[0, 9] = float("nan")
    x[1] = float("-inf")
    x[2, 3] = float("inf")
    ours = native.top_k_top_p_(x.clone(), torch.tensor([2, 2, 2]), torch.tensor([0.5, 0.5, 0.5]))
    assert ours is not None
    assert torch.equal(ours[:2].isnan(), x[:2].isnan())
    assert torch.equal(ours[0].nan_to_num(), x[0].nan_to_num()) and torch.equal(ours[1], x[1])
    assert torch.isfinite(ours[2]).sum() + torch.isinf(ours[2]).logical_and(ours[2] > 0).sum() == 2


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize(
    ("bad", "expected"), [("nan", 5), ("inf", 3), ("-inf", 0)], ids=["nan", "inf", "all_-inf"]
)
def test_a_row_without_a_distribution_draws_its_argmax_inside_the_vocabulary(
    bad, expected, kernel, monkeypatch
):
    """A row holding a NaN or +inf (a model's overflow), or only -inf, has no softmax to draw
    from: it draws its argmax as torch answers it (the first NaN, else the first maximum), never
    the vocabulary's size — an id no embedding holds, which the next step would look up. The
    other rows draw as usual."""
    if kernel and native.kernels() is None:
        pytest.skip("the native kernels are not built here")
    if not kernel:
        monkeypatch.setattr(native, "draw", lambda x, u: None)
        monkeypatch.setattr(native, "top_k_top_p_", lambda x, k, p: None)
    logits = logits_rows(3, seed=1)
    if bad == "nan":
        logits[1, [5, 9]] = float("nan")
    elif bad == "inf":
        logits[1, [3, 11]] = float("inf")
    else:
        logits[1] = float("-inf")
    for params in (
        DrawParams(temperature=1.0),
        DrawParams(temperature=0.7, seed=3),
        DrawParams(temperature=1.0, top_p=0.5),
        DrawParams(temperature=1.0, top_k=4, min_p=0.1),
    ):
        out = draw(logits.clone(), [params] * 3, positions=[4, 5, 6]).token_ids
        assert out[1] == expected, params
        assert ((out >= 0) & (out < VOCAB)).all(), params


@pytest.mark.parametrize("vocab", [16, 5000, 151_936, 600_000])  # one block, many, grown blocks
def test_native_draw_lands_where_the_cumulative_softmax_crosses_u(vocab):
    """`native.draw` answers the inverse CDF of each row's softmax: the drawn token's cumulative
    probability (float64) reaches u and the one before it does not, within float32 rounding of
    the sums; filtered (-inf) tokens are never drawn, nor a token past the vocabulary, at u = 1
    and at the smallest u either."""
    if native.kernels() is None:
        pytest.skip("the native kernels are not built here")
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen) * 3
    x[1, ::2] = float("-inf")  # half the row filtered
    x[2, : vocab - 3] = float("-inf")  # three tokens left, at the end
    x[3, 1:] = float("-inf")  # one token left, the first
    u = torch.rand(6, generator=gen).clamp_min(1e-6)
    u[4], u[5] = 1.0, 2.0**-24
    tokens = native.draw(x, u)
    assert tokens is not None
    cdf = torch.softmax(x.double(), -1).cumsum(-1)
    for r, t in enumerate(tokens.tolist()):
        assert 0 <= t < vocab and torch.isfinite(x[r, t]), (r, t)
        assert cdf[r, t] >= u[r].item() - 1e-5, (r, t)
        assert t == 0 or cdf[r, t - 1] < u[r].item() + 1e-5, (r, t)
    assert tokens[3] == 0 and tokens[2] >= vocab - 3


def test_seeded_draws_follow_the_softmax_across_seeds_and_positions():
    """A seeded row's uniform is a hash of (seed, position): over many seeds at one position,
    and one seed over many positions, the draws are distributed as the softmax (a weak hash
    would bunch them)."""
    row = logits_rows(1)
    n = 4000
    expected = torch.softmax(row[0] / 0.7, -1)
    by_seed = draw(row.expand(n, VOCAB), [DrawParams(temperature=0.7, seed=s) for s in range(n)])
    by_pos = draw(
        row.expand(n, VOCAB), [DrawParams(temperature=0.7, seed=11)] * n, positions=list(range(n))
    )
    for out in (by_seed, by_pos):
        freq = torch.bincount(out.token_ids, minlength=VOCAB).float() / n
        assert (freq - expected).abs().max() < 0.03


def test_min_p_filters_only_its_own_rows():
    """min-p is a floor at max + ln(min_p) in each row's tempered logits: a row at 0 keeps every
    token beside a row that filters, and a filtering row keeps exactly p ≥ min_p · p_max."""
    logits = logits_rows(2, seed=12)
    params = [DrawParams(temperature=0.8), DrawParams(temperature=0.8, min_p=0.3)]
    processed = processed_logits(logits, SamplingBatch.from_params(params, [0, 0], VOCAB))
    assert torch.isfinite(processed[0]).all()
    probs = torch.softmax(logits[1].double() / 0.8, -1)
    assert torch.equal(torch.isfinite(processed[1]), probs >= 0.3 * probs.max())

"""Logprobs from the engine to a response: the engine's per-token `TokenLogprobs` as the server's
`TokenLogprob`s, with text (`token_logprobs`, `prompt_logprobs`, on the engine's thread), and how
those render — the legacy completion shape, chat's, and vLLM's `prompt_logprobs`; -inf becomes
-9999.0 (JSON has no infinities) and tokens show as text or, on request, as vLLM's
`token_id:<id>`. Pure functions."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvtier.sched.output import TokenLogprobs
from kvtier.server.events import TokenLogprob

# vLLM's floor for a logprob: -inf (a token the filters removed) renders as this finite value.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """`value` if finite, else MIN_LOGPROB (JSON has no -Infinity; NaN never is a logprob)."""
    return value if math.isfinite(value) else MIN_LOGPROB


def _finite(logprob: float | None) -> float | None:
    return None if logprob is None else finite_logprob(logprob)


def _name(token: str, token_id: int, as_ids: bool) -> str:
    """A token as the response shows it: its text, or vLLM's `token_id:<id>` when
    `return_tokens_as_token_ids` asked for ids (text that is not valid alone stays readable)."""
    return f"token_id:{token_id}" if as_ids else token


def completion_logprobs(
    lps: list[TokenLogprob], offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """The `logprobs` object of a completion choice (legacy shape); -inf becomes -9999.0 and a
    prompt's first token has null entries."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [_name(lp.token, lp.token_id, as_ids) for lp in lps],
        "token_logprobs": [_finite(lp.logprob) for lp in lps],
        "top_logprobs": [
            None
            if lp.logprob is None
            else {
                _name(t, i, as_ids): finite_logprob(v)
                for (t, v), i in zip(lp.top, lp.top_ids, strict=True)
            }
            for lp in lps
        ],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob], as_ids: bool = False) -> dict[str, Any]:
    """The `logprobs` object of a chat choice; -inf becomes -9999.0."""

    def entry(token: str, token_id: int, logprob: float | None) -> dict[str, Any]:
        name = _name(token, token_id, as_ids)
        return {"token": name, "logprob": _finite(logprob), "bytes": list(name.encode())}

    content = [
        entry(lp.token, lp.token_id, lp.logprob)
        | {"top_logprobs": [entry(t, i, v) for (t, v), i in zip(lp.top, lp.top_ids, strict=True)]}
        for lp in lps
    ]
    return {"content": content}


def vllm_prompt_logprobs(lps: list[TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first), its id and each top
    candidate's → logprob, rank (1 = likeliest) and decoded text. The token's own rank is null
    when it may lie outside the top candidates (their ranks are exact either way)."""
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp.logprob is None:
            out.append(None)
            continue
        values = [v for _, v in lp.top]
        others = [v for (_, v), i in zip(lp.top, lp.top_ids, strict=True) if i != lp.token_id]
        entry: dict[str, Any] = {}
        for (text, v), i in zip(lp.top, lp.top_ids, strict=True):
            rank: int | None = 1 + sum(1 for x in values if x > v)
            if i == lp.token_id and (not others or v < min(others)):
                rank = None
            entry[str(i)] = {"logprob": finite_logprob(v), "rank": rank, "decoded_token": text}
        out.append(entry)
    return out


def _with_text(
    decode: Callable[..., str], tok: int, logprob: float | None, top: dict[int, float]
) -> TokenLogprob:
    """One token with its logprob and its candidates (id → logprob), each as text."""

    def text(token_id: int) -> str:
        return decode([token_id], skip_special_tokens=False)

    return TokenLogprob(text(tok), logprob, [(text(t), v) for t, v in top.items()], tok, list(top))


def token_logprobs(
    decode: Callable[..., str], token_ids: list[int], logprobs: list[TokenLogprobs]
) -> list[TokenLogprob]:
    """Each token with its logprob and top candidates, as text."""
    return [_with_text(decode, tok, lp.logprob, lp.top) for tok, lp in zip(token_ids, logprobs)]


def prompt_logprobs(
    decode: Callable[..., str], prompt: list[int], logprobs: list[TokenLogprobs | None]
) -> list[TokenLogprob]:
    """Every prompt token with its logprob and top candidates, the token's own first (the
    first token has none)."""
    return [
        _with_text(decode, tok, None, {})
        if lp is None
        else _with_text(decode, tok, lp.logprob, {tok: lp.logprob} | lp.top)
        for tok, lp in zip(prompt, logprobs, strict=True)
    ]

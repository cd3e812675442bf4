"""The request loop of `kvtier bench serve`: streaming `/v1/completions` over httpx, one task per
conversation, Poisson starts, a concurrency cap, and a timeout on every request."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvtier.bench.serve_data import Conversation, Tok, concat, extend, length


@dataclass
class Record:
    """One request's outcome. Times are seconds; `start` is from the benchmark's start."""

    conversation: int
    round: int
    max_tokens: int
    prompt_len: int | None  # the client's count (token ids, or the tokenizer's), None if unknown
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    count_source: str = ""

    def as_dict(self, keep_text: bool) -> dict[str, Any]:
        d = asdict(self)
        if not keep_text:
            d.pop("text")
        return d


@dataclass
class Settings:
    url: str  # the completions endpoint
    model: str
    ignore_eos: bool
    temperature: float
    timeout: float
    extra: dict[str, Any] = field(default_factory=dict)
    # sent with each conversation's id on every one of its requests (a router's session key)
    session_header: str | None = None


async def send(
    client: httpx.AsyncClient, s: Settings, prompt: Any, rec: Record, t_bench: float
) -> None:
    """Stream one completion into `rec`; any failure is recorded, never raised."""
    body: dict[str, Any] = {
        "model": s.model,
        "prompt": prompt,
        "max_tokens": rec.max_tokens,
        "temperature": s.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | s.extra
    if s.ignore_eos:
        body["ignore_eos"] = True
    headers = {s.session_header: f"conversation-{rec.conversation}"} if s.session_header else {}
    t0 = time.perf_counter()
    rec.start = t0 - t_bench
    last, done = t0, False
    try:
        stream = client.stream("POST", s.url, json=body, headers=headers)
        async with asyncio.timeout(s.timeout), stream as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {raw[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return
                now = time.perf_counter()
                if choices := obj.get("choices"):
                    if rec.chunks == 0:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunks += 1
                    rec.text += choices[0].get("text") or ""
                    rec.finish_reason = choices[0].get("finish_reason") or rec.finish_reason
                if obj.get("usage"):
                    rec.usage = obj["usage"]
        rec.latency = time.perf_counter() - t0
        if not done and rec.finish_reason is None:
            rec.error = "stream ended without [DONE]"
        elif rec.chunks == 0:
            rec.error = "no tokens streamed"
        else:
            rec.success = True
    except (TimeoutError, httpx.TimeoutException):
        rec.error = f"timeout after {s.timeout:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


def count(rec: Record, tok: Tok | None) -> None:
    """Fill input/output/cached token counts: the server's usage when reported, else the
    tokenizer's (or the client's prompt length), else the streamed chunk count."""
    u = rec.usage or {}
    details = u.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")
    if "prompt_tokens" in u and "completion_tokens" in u:
        rec.input_tokens, rec.output_tokens = int(u["prompt_tokens"]), int(u["completion_tokens"])
        rec.count_source = "usage"
        return
    rec.input_tokens = rec.prompt_len or 0
    if tok is not None:
        rec.output_tokens, rec.count_source = tok.count(rec.text), "tokenizer"
    else:
        rec.output_tokens, rec.count_source = rec.chunks, "chunks"


async def run_all(
    convs: list[Conversation],
    s: Settings,
    tok: Tok | None,
    max_concurrency: int | None,
    base_url: str,
) -> tuple[list[Record], float]:
    """Run every conversation; returns the records (in completion order) and the duration."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # 0 is unlimited, as for the semaphore: httpx would take it as a pool of no connections
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)
    timeout = httpx.Timeout(s.timeout)
    records: list[Record] = []
    t_bench = time.perf_counter()
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, trust_env=False
    ) as client:

        async def conversation(c: Conversation) -> None:
            await asyncio.sleep(c.start_delay)
            history = c.prefix
            for r, (q, olen) in enumerate(zip(c.questions, c.output_lens)):
                prompt = concat(history, q)
                rec = Record(c.index, r, olen, length(prompt, tok))
                if sem is None:
                    await send(client, s, prompt, rec, t_bench)
                else:
                    async with sem:
                        await send(client, s, prompt, rec, t_bench)
                count(rec, tok)
                records.append(rec)
                if not rec.success:
                    for r2 in range(r + 1, len(c.questions)):
                        skipped = Record(c.index, r2, c.output_lens[r2], None)
                        skipped.error = "skipped: an earlier round failed"
                        records.append(skipped)
                    return
                history = extend(prompt, rec.text, tok)

        await asyncio.gather(*(conversation(c) for c in convs))
    return records, time.perf_counter() - t_bench

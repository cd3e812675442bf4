"""The official `openai` client against a real server: completions, chat, streaming, stop strings,
concurrency; greedy text must equal the offline engine's."""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier import LLM, SamplingParams
from tests.server.conftest import MODEL, ServerHandle

PROMPT = (
    "The with statement is used to wrap the execution of a block with methods defined by a "
    "context manager. This allows common try, except and finally usage patterns to be kept"
)


def test_models_lists_the_served_name(server: ServerHandle) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert (models[0].model_extra or {})["max_model_len"] == 512


def test_greedy_completion_equals_offline_engine_and_reports_cached_tokens(
    server: ServerHandle,
) -> None:
    client = server.client()
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    offline = LLM(max_model_len=512).generate(
        PROMPT, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False
    )[0]
    assert first.choices[0].text == offline.outputs[0].text
    assert again.choices[0].text == first.choices[0].text
    assert first.choices[0].finish_reason == "length"
    usage = again.usage
    assert usage is not None and usage.completion_tokens == 24
    assert usage.prompt_tokens == len(offline.prompt_token_ids)
    assert usage.total_tokens == usage.prompt_tokens + 24
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 16  # the first full block came from cache


def test_token_id_prompts_and_several_prompts(server: ServerHandle) -> None:
    client = server.client()
    text = client.completions.create(model=MODEL, prompt="The for", max_tokens=8, temperature=0)
    ids = LLM(max_model_len=512).get_tokenizer().encode("The for")
    both = client.completions.create(
        model=MODEL, prompt=[ids, ids], max_tokens=8, temperature=0, echo=True
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == "The for" + text.choices[0].text
    assert both.choices[1].text == both.choices[0].text
    assert both.usage is not None and both.usage.completion_tokens == 16


def test_chat_completion_with_default_template(server: ServerHandle) -> None:
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=10,
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 10
    # the plain template: "system: Be brief.\nuser: Hi\nassistant:" (byte-level BPE: ≥ 10 tokens)
    assert chat.usage.prompt_tokens >= 10


def test_streaming_equals_non_streaming(server: ServerHandle) -> None:
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20

    messages = [{"role": "user", "content": "Tell me about loops"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def test_sse_ends_with_done(server: ServerHandle) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": MODEL, "prompt": "The if", "max_tokens": 4, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_stop_string_cuts_the_text(server: ServerHandle) -> None:
    client = server.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_concurrent_requests_match_sequential_ones(server: ServerHandle) -> None:
    client = server.client()
    prompts = [f"The {word} statement" for word in ("if", "for", "while", "try", "with", "def")]

    def run(prompt: str) -> str:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        return out.choices[0].text

    sequential = [run(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(run, prompts))
    assert concurrent == sequential


def test_logprobs_of_greedy_tokens_are_the_top_candidates(server: ServerHandle) -> None:
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert lp.top_logprobs is not None and all(len(top) == 2 for top in lp.top_logprobs)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and abs(value - max(top.values())) < 1e-5
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert tokens == lp.tokens

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    assert all(len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()) for t in content)
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == chat.choices[0].message.content


def test_streaming_several_prompts_with_echo_and_usage(server: ServerHandle) -> None:
    client = server.client()
    prompts = ["The for statement", "The while statement"]
    whole = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0, echo=True
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompts,
            max_tokens=8,
            temperature=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert texts[0].startswith(prompts[0]) and texts[1].startswith(prompts[1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(server: ServerHandle) -> None:
    """vLLM's echo without generation: the prompt text and its tokens' logprobs (legacy format:
    null for the first token), equal to the offline engine's prompt_logprobs."""
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    llm = LLM(max_model_len=512)
    offline = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    ids, expected = offline[0].prompt_token_ids, offline[0].prompt_logprobs
    assert expected is not None
    tok = llm.get_tokenizer()
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t, value, top, want in zip(
        ids[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], expected[1:], strict=True
    ):
        assert want is not None and value == pytest.approx(want[t], abs=1e-5)
        assert 2 <= len(top) <= 3  # the top 2 and the prompt token
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert choice.finish_reason == "length"
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert tokens == lp.tokens
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_echo_with_logprobs_puts_the_prompts_before_the_completions(server: ServerHandle) -> None:
    client = server.client()
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "logprobs": 1, "temperature": 0}
    alone = client.completions.create(**kwargs).choices[0]
    response = client.completions.create(**kwargs, echo=True)
    echoed = response.choices[0]
    assert echoed.text == PROMPT + alone.text
    a, e = alone.logprobs, echoed.logprobs
    assert a is not None and e is not None and a.tokens is not None and e.tokens is not None
    assert e.token_logprobs is not None and a.token_logprobs is not None
    assert e.text_offset is not None and a.text_offset is not None
    n = len(e.tokens) - len(a.tokens)
    assert response.usage is not None and n == response.usage.prompt_tokens
    assert e.tokens[n:] == a.tokens  # prefix-cached or not: equal up to rounding
    assert e.token_logprobs[n:] == pytest.approx(a.token_logprobs, abs=1e-5)
    assert e.token_logprobs[0] is None and all(v is not None for v in e.token_logprobs[1:])
    assert "".join(e.tokens[:n]) == "<bos>" + PROMPT  # token texts, special ones too (as vLLM)
    assert e.text_offset == [sum(map(len, e.tokens[:i])) for i in range(len(e.tokens))]
    streamed = list(client.completions.create(**kwargs, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == echoed.text
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert tokens == e.tokens


def test_max_tokens_0_needs_echo(server: ServerHandle) -> None:
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"

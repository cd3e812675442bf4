"""Drop-in for vLLM's clients: the exact bodies `vllm bench serve` (its `openai` and
`openai-chat` backends), sglang-router and vllm-router send are all answered; unknown fields are
ignored with one warning per name; vLLM's extensions do what vLLM does with them; chat history
reaches the template as `transformers`' `apply_chat_template` receives it."""

from __future__ import annotations

import http.client
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from kvtier import LLM, SamplingParams
from kvtier.engine.params import EngineArgs
from kvtier.engine.prompts import ChatOptions, render_chat
from kvtier.model.tokenizer import Tokenizer
from kvtier.server.protocol import ChatCompletionRequest
from tests.server.conftest import MODEL, ServerHandle

PROMPT = "The with statement is used to wrap the execution of a block"
TEXT_PART = [{"type": "text", "text": PROMPT}]

# `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py): the default `openai` backend
# posts to /v1/completions, `--backend openai-chat` to /v1/chat/completions; `model` is the
# served name, or the first card's id when --model is not given.
BENCH_COMPLETION = {
    "model": MODEL,
    "prompt": PROMPT,
    "repetition_penalty": 1.0,
    "max_tokens": 6,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
}
BENCH_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": TEXT_PART}],
    "max_completion_tokens": 6,
    "stream": True,
    "stream_options": {"include_usage": True},
}
# sglang-router (sgl-router/src/protocols) re-serializes with its serde defaults written out
SGLANG_CHAT = {
    "messages": [{"role": "user", "content": PROMPT}],
    "model": MODEL,
    "logprobs": False,
    "max_tokens": 6,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
SGLANG_COMPLETION = {
    "model": MODEL,
    "prompt": PROMPT,
    "max_tokens": 6,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
# vllm-router (vllm-project/router src/protocols/spec.rs): `model` optional and left out when
# the client left it out; reasoning defaults written out
VLLM_ROUTER_CHAT = {
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
    "stream": False,
    "max_tokens": 6,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
VLLM_ROUTER_COMPLETION = {
    "prompt": PROMPT,
    "max_tokens": 6,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def _without_model(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "model"}


def _sse(server: ServerHandle, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200, raw
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", raw
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", BENCH_COMPLETION),
        ("/v1/completions", _without_model(BENCH_COMPLETION)),
        ("/v1/completions", BENCH_COMPLETION | {"ignore_eos": True}),
        ("/v1/chat/completions", BENCH_CHAT),
        ("/v1/chat/completions", _without_model(BENCH_CHAT)),
        ("/v1/chat/completions", BENCH_CHAT | {"temperature": 0.0, "ignore_eos": True}),
    ],
)
def test_vllm_bench_serve_bodies_stream_with_usage(
    server: ServerHandle, path: str, body: dict[str, Any]
) -> None:
    chunks = _sse(server, path, body)
    *tokens, usage = chunks
    assert tokens and all(c["choices"] for c in tokens)
    assert all(c["model"] == MODEL for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert usage["usage"]["prompt_tokens"] > 5


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", SGLANG_CHAT),
        ("/v1/completions", SGLANG_COMPLETION),
        ("/v1/chat/completions", VLLM_ROUTER_CHAT),
        ("/v1/completions", VLLM_ROUTER_COMPLETION),
    ],
)
def test_router_bodies_are_answered(server: ServerHandle, path: str, body: dict[str, Any]) -> None:
    status, out = server.post(path, body)
    assert status == 200, out
    assert out["model"] == MODEL and len(out["choices"]) == 1
    assert out["usage"]["completion_tokens"] >= 1


def test_unknown_fields_are_ignored_with_one_warning_per_name(
    server: ServerHandle, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    extra = {"frobnicate_dropin": {"x": 1}, "session_params_dropin": 3}
    with caplog.at_level(logging.WARNING, logger="kvtier.server"):
        plain = server.post("/v1/completions", body)
        for _ in range(3):
            status, out = server.post("/v1/completions", body | extra)
            assert status == 200 and out["choices"][0]["text"] == plain[1]["choices"][0]["text"]
    warned = [r.getMessage() for r in caplog.records if "dropin" in r.getMessage()]
    assert len(warned) == 2, warned
    assert any("'frobnicate_dropin'" in w for w in warned)


def _post_ok(server: ServerHandle, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = server.post(path, body)
    assert status == 200, out
    return out


def test_request_id_names_the_response_and_may_repeat(server: ServerHandle) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "request_id": "abc-123"}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: _post_ok(server, "/v1/completions", body), range(2)))
    assert [o["id"] for o in outs] == ["cmpl-abc-123"] * 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "r9"}
    assert _post_ok(server, "/v1/chat/completions", chat)["id"] == "chatcmpl-r9"


def test_add_special_tokens_and_truncate_prompt_tokens(server: ServerHandle) -> None:
    tok = server.engine.call(lambda e: e.tokenizer)
    body = {"prompt": PROMPT, "max_tokens": 1}
    with_bos = _post_ok(server, "/v1/completions", body)["usage"]["prompt_tokens"]
    without = {"add_special_tokens": False}
    bare = _post_ok(server, "/v1/completions", body | without)["usage"]["prompt_tokens"]
    assert with_bos == len(tok.encode(PROMPT)) and bare == len(tok.encode(PROMPT, False))
    assert with_bos == bare + 1
    # a prompt far over max_model_len (512) keeps only its last 7 tokens
    long_text = "word " * 3000 + PROMPT
    # without truncation it is refused
    status, _ = server.post("/v1/completions", body | {"prompt": long_text})
    assert status == 400
    cut = {"prompt": long_text, "truncate_prompt_tokens": 7, "echo": True}
    out = _post_ok(server, "/v1/completions", body | cut)
    assert out["usage"]["prompt_tokens"] == 7
    expected = tok.decode(tok.encode(long_text)[-7:])
    assert out["choices"][0]["text"].startswith(expected)
    ids = tok.encode(PROMPT)
    out = _post_ok(server, "/v1/completions", body | {"prompt": ids, "truncate_prompt_tokens": 3})
    assert out["usage"]["prompt_tokens"] == 3


def test_prompt_logprobs_in_vllm_shape(server: ServerHandle) -> None:
    """Per prompt token (null for the first): the token's and the top candidates' logprobs,
    equal to the offline engine's, each with its rank and decoded text."""
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    plps = _post_ok(server, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    llm = LLM(max_model_len=512)
    offline = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    ids, expected = offline[0].prompt_token_ids, offline[0].prompt_logprobs
    tok = llm.get_tokenizer()
    assert expected is not None and len(plps) == len(ids) and plps[0] is None
    for token_id, entry, want in zip(ids[1:], plps[1:], expected[1:], strict=True):
        assert want is not None and {int(k) for k in entry} == set(want)
        values = [e["logprob"] for e in entry.values()]
        for key, e in entry.items():
            assert e["logprob"] == pytest.approx(want[int(key)], abs=1e-5)
            assert e["decoded_token"] == tok.decode([int(key)], skip_special_tokens=False)
            rank = 1 + sum(v > e["logprob"] for v in values)
            # the prompt token's own rank is unknown (null) when it may lie below the top 2
            assert e["rank"] == rank or (int(key) == token_id and e["rank"] is None)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    out = _post_ok(server, "/v1/chat/completions", chat)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) > 2


def test_tokens_as_token_ids_and_continuous_usage(server: ServerHandle) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True}
    lps = _post_ok(server, "/v1/completions", body | {"ignore_eos": True})["choices"][0]
    assert all(t.startswith("token_id:") for t in lps["logprobs"]["tokens"])
    assert all(k.startswith("token_id:") for d in lps["logprobs"]["top_logprobs"] for k in d)
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *chunks, last = _sse(server, "/v1/chat/completions", chat)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4, counts
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)


def test_continue_final_message_leaves_the_last_message_open(server: ServerHandle) -> None:
    tok = server.engine.call(lambda e: e.tokenizer)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Once upon"},
    ]
    body = {"messages": messages, "max_tokens": 1}
    opened = body | {"continue_final_message": True, "add_generation_prompt": False}
    got = _post_ok(server, "/v1/chat/completions", opened)["usage"]["prompt_tokens"]
    # the plain template (this model has none): `role: content` lines, the last one left open
    assert got == len(tok.encode("user: hi\nassistant: Once upon"))
    closed = body | {"add_generation_prompt": False}
    assert _post_ok(server, "/v1/chat/completions", closed)["usage"]["prompt_tokens"] > got


TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }}"
    "({{ c.function.arguments.city }}){% endfor %}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if style %}({{ style }}){% endif %}"
)


def test_tool_history_reaches_the_template_as_transformers_gives_it() -> None:
    """tool_calls (arguments parsed to objects, as vLLM hands them over), tool_call_id and name
    render exactly as `transformers`' apply_chat_template renders the same conversation;
    content parts are joined with a newline; chat_template_kwargs are template variables."""
    transformers = pytest.importorskip("transformers")
    folder = EngineArgs.from_kwargs(None).model_path
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city":"Oslo"}'},
    }
    body = {
        "messages": [
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "chat_template_kwargs": {"style": "terse"},
    }
    req = ChatCompletionRequest.model_validate(body)
    ours = render_chat(
        Tokenizer(
            HFTokenizer.from_file(str(folder / "tokenizer.json")), chat_template=TOOL_TEMPLATE
        ),
        req.dict_messages(),
        ChatOptions(True, False, req.chat_template_kwargs),
    )
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    expected_messages = [
        {"role": "user", "name": "ann", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call | {"function": {"name": "w", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    theirs = hf.apply_chat_template(
        expected_messages,
        chat_template=TOOL_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        style="terse",
    )
    assert ours == theirs
    assert "<user ann>a\nb" in ours and "call w(Oslo)" in ours and "[c1]sunny" in ours
    assert ours.endswith("<assistant>(terse)")

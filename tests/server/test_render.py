"""vLLM's render endpoints, `/v1/completions/render` and `/v1/chat/completions/render`: the
`GenerateRequest` shape vLLM 0.32 returns (a list for completions, one object for chat), token
ids equal to those the generation route hands the engine for the same body, and the same 400s.
vllm-router's kv_aware policy posts a client's body here and reads `token_ids`."""

from __future__ import annotations

from typing import Any

from tests.server.conftest import MODEL, ServerHandle

# vLLM 0.32's GenerateRequest fields (vllm/entrypoints/scale_out/token_in_token_out/protocol.py)
GENERATE_REQUEST_KEYS = {
    "request_id",
    "token_ids",
    "token_offsets",
    "features",
    "content_parts",
    "sampling_params",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "output_mode",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "ec_transfer_params",
}
TEXT = "The quick brown fox jumps over the lazy dog, then rests by the river bank."


def _echoed_ids(server: ServerHandle, prompt: Any) -> list[int]:
    """The token ids the engine was handed for `prompt`, as an echo with logprobs returns them."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 0,
        "temperature": 0,
        "return_tokens_as_token_ids": True,
    }
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    tokens = out["choices"][0]["logprobs"]["tokens"]
    n = out["usage"]["prompt_tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens[:n]]


def test_completion_render_is_a_list_of_vllm_generate_requests(server: ServerHandle):
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 7, "temperature": 0.5, "seed": 3}
    status, out = server.post("/v1/completions/render", body)
    assert status == 200, out
    assert isinstance(out, list) and len(out) == 1
    (item,) = out
    assert set(item) == GENERATE_REQUEST_KEYS
    assert item["token_ids"] == _echoed_ids(server, TEXT)
    assert item["features"] is None and item["output_mode"] == "tokens"
    assert item["request_id"].startswith("cmpl-") and item["model"] == MODEL
    sp = item["sampling_params"]
    assert (sp["n"], sp["max_tokens"], sp["temperature"], sp["seed"]) == (1, 7, 0.5, 3)


def test_completion_render_gives_one_entry_per_prompt_and_keeps_token_ids(server: ServerHandle):
    ids = [11, 22, 33, 44]
    body = {"model": MODEL, "prompt": [TEXT, "a second prompt"], "request_id": "r7"}
    status, out = server.post("/v1/completions/render", body)
    assert status == 200, out
    assert [o["request_id"] for o in out] == ["cmpl-r7-0", "cmpl-r7-1"]
    assert out[1]["token_ids"] == _echoed_ids(server, "a second prompt")
    status, out = server.post("/v1/completions/render", {"model": MODEL, "prompt": ids})
    assert status == 200 and out[0]["token_ids"] == ids


def test_chat_render_is_one_generate_request_with_the_templated_tokens(server: ServerHandle):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": TEXT},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5}
    status, item = server.post("/v1/chat/completions/render", body)
    assert status == 200, item
    assert isinstance(item, dict) and set(item) == GENERATE_REQUEST_KEYS
    assert item["request_id"].startswith("chatcmpl-")
    # what the chat route hands the engine: its usage and its prompt logprobs (keyed by token
    # id; the first token has none)
    status, out = server.post(
        "/v1/chat/completions", body | {"prompt_logprobs": 0, "temperature": 0, "max_tokens": 1}
    )
    assert status == 200, out
    assert len(item["token_ids"]) == out["usage"]["prompt_tokens"]
    entries = out["prompt_logprobs"][1:]
    assert all(len(lp) == 1 for lp in entries)  # prompt_logprobs=0: the token's own only
    assert item["token_ids"][1:] == [int(next(iter(lp))) for lp in entries]


def test_render_refuses_what_generation_refuses_with_a_400_naming_the_field(server: ServerHandle):
    cases: list[tuple[str, dict[str, Any], str | None]] = [
        ("/v1/completions/render", {"model": MODEL}, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": []}, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": [10**9]}, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions/render", {"model": MODEL, "prompt": "x " * 600}, "prompt"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": "hi"}, "messages"),
    ]
    for path, body, param in cases:
        status, out = server.post(path, body)
        assert status == 400, (path, body, out)
        assert out["error"]["param"] == param or param in out["error"]["message"], out
        gen_status, gen = server.post(path.removesuffix("/render"), body)
        assert (gen_status, gen["error"]["param"]) == (400, out["error"]["param"])
    status, out = server.post("/v1/completions/render", {"model": "other", "prompt": "x"})
    assert status == 404, out

"""Penalties, logit_bias, bad_words and allowed_token_ids through the HTTP API with the `openai`
client: applied (a bias of +100 forces a token, -100 bans it; greedy text equals the offline
engine's with the same parameters), never accepted and ignored."""

from __future__ import annotations

from kvtier import LLM, SamplingParams
from tests.server.conftest import MODEL, ServerHandle

PROMPT = "The with statement is used to wrap the execution of a block with methods"


def offline(**kw: object) -> str:
    llm = LLM(max_model_len=512)
    params = SamplingParams(max_tokens=16, temperature=0.0, **kw)  # type: ignore[arg-type]
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def test_a_bias_of_100_forces_the_token_and_minus_100_bans_it(server: ServerHandle) -> None:
    client = server.client()
    tok = LLM(max_model_len=512).get_tokenizer()
    (x,) = tok.encode("x", add_special_tokens=False)
    forced = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, logit_bias={str(x): 100}
    )
    assert forced.choices[0].text == "x" * 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logit_bias={str(x): 250},  # clamped to 100, as vLLM
    )
    assert chat.choices[0].message.content == "x" * 4
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    first = tok.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != plain.choices[0].text


def test_penalties_bad_words_and_allowed_ids_equal_the_offline_engine(
    server: ServerHandle,
) -> None:
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    controls: list[dict[str, object]] = [
        {"presence_penalty": 1.5, "frequency_penalty": 1.0},
        {"repetition_penalty": 1.8},
        {"bad_words": [plain.choices[0].text.split()[0]]},
    ]
    tok = LLM(max_model_len=512).get_tokenizer()
    allowed = tok.encode(" the a of", add_special_tokens=False)
    controls.append({"allowed_token_ids": allowed})
    for kw in controls:
        openai_kw = {k: v for k, v in kw.items() if k in ("presence_penalty", "frequency_penalty")}
        extra = {k: v for k, v in kw.items() if k not in openai_kw}
        got = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body=extra,
            **openai_kw,  # type: ignore[arg-type]
        )
        text = got.choices[0].text
        assert text == offline(**kw), kw
        assert text != plain.choices[0].text, kw
    only = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body=controls[-1]
    )
    assert set(tok.encode(only.choices[0].text, add_special_tokens=False)) <= set(allowed)

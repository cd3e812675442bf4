"""Stop strings, stop tokens and min_tokens as vLLM has them, seen through the engine's stream of
`StepOutput`s: streamed text and token ids add up to the final ones, whatever a step brings."""

from __future__ import annotations

import pytest

from kvtier.engine import LLM, EngineArgs, EngineCore, SamplingParams
from kvtier.engine.core import StepOutput

# The n-gram proposer copies the prompt's '"__getitem__()" or' after the first '\n': the second
# step of a greedy run brings four tokens at once.
DRAFTED = (
    'A class definition defines\n"__getitem__()" and "__class_getitem__()" that has no arguments'
)
GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512)


def drafting_engine(async_scheduling: bool) -> EngineCore:
    args = EngineArgs.from_kwargs(
        None,
        device="sim",
        num_speculative_tokens=3,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    return EngineCore(args)


def run(engine: EngineCore, requests: dict[str, SamplingParams], prompt: str) -> dict[str, list]:
    """Every request's StepOutputs, in order (the engine drained)."""
    ids = engine.tokenizer.encode(prompt)
    for req_id, params in requests.items():
        engine.add_request(req_id, ids, params)
    outs: dict[str, list[StepOutput]] = {req_id: [] for req_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.req_id].append(out)
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_at_the_first_of_several_tokens_drops_the_rest_from_the_stream(
    async_scheduling: bool,
) -> None:
    engine = drafting_engine(async_scheduling)
    base = run(engine, {"base": GREEDY}, DRAFTED)["base"]
    assert [len(o.new_token_ids) for o in base[:2]] == [1, 4]  # drafts accepted in step 2
    first = base[1].new_token_ids[0]
    assert engine.tokenizer.decode([first]) == '"__'
    kept = [base[0].new_token_ids[0], first]
    cases = {
        "string": SamplingParams(max_tokens=10, temperature=0, stop='"__'),
        "token": SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first]),
    }
    outs = run(engine, cases, DRAFTED)
    results = {}
    for req_id, steps in outs.items():
        state = results[req_id] = steps[-1].result
        assert state is not None and all(o.result is None for o in steps[:-1]), req_id
        assert state.finish_reason == "stop", req_id
        assert state.token_ids == kept, req_id
        assert [t for o in steps for t in o.new_token_ids] == kept, req_id
        assert "".join(o.new_text for o in steps) == state.text == "\n", req_id
        assert steps[-1].finished and not any(o.finished for o in steps[:-1])
    assert results["string"].stop_reason == '"__'
    assert results["token"].stop_reason == first


def test_streamed_text_never_carries_a_stop_string_start_the_final_text_drops() -> None:
    engine = drafting_engine(async_scheduling=True)
    text = run(engine, {"base": GREEDY}, DRAFTED)["base"]
    full = "".join(o.new_text for o in text)
    stops = {f"s{i}": full[i : i + 4] for i in range(1, len(full) - 4, 3)}
    params = {
        req_id: SamplingParams(max_tokens=10, temperature=0, stop=[stop, "@@@@@@"])
        for req_id, stop in stops.items()
    }
    outs = run(engine, params, DRAFTED)
    for req_id, steps in outs.items():
        state = steps[-1].result
        assert state is not None and state.text == full[: full.index(stops[req_id])]
        assert "".join(o.new_text for o in steps) == state.text, stops[req_id]


def test_min_tokens_holds_back_stop_strings(llm: LLM) -> None:
    """As vLLM: a stop string counts only once it ends past the first `min_tokens` tokens."""
    base = llm.generate("A class definition defines", GREEDY, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert [tok.decode([t]) for t in base.token_ids[:2]] == ["\n", '"__']
    params = SamplingParams(max_tokens=10, temperature=0, stop='"__', min_tokens=2)
    out = llm.generate("A class definition defines", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"__'
    assert out.text == '\n"__getitem__()" and '  # the second '"__' ends it
    assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_ignore_eos_keeps_stop_tokens_masked_before_min_tokens(llm: LLM) -> None:
    base = llm.generate("The for loop", GREEDY, use_tqdm=False)[0].outputs[0]
    first = base.token_ids[0]
    params = SamplingParams(
        max_tokens=8, min_tokens=4, temperature=0, ignore_eos=True, stop_token_ids=[first]
    )
    out = llm.generate("The for loop", params, use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:4]
    assert llm.engine.eos_token_id not in out.token_ids[:4]


def test_ignore_eos_with_eos_among_stop_token_ids_stops_there(llm: LLM) -> None:
    """vLLM: ignore_eos drops only the implicit EOS stop; EOS listed in stop_token_ids still
    stops, and is then the stop_reason. The stop token's text is left out, as vLLM does."""
    eos = llm.engine.eos_token_id
    assert eos is not None
    natural = llm.generate("Return", SamplingParams(max_tokens=60, temperature=0), use_tqdm=False)
    first = natural[0].outputs[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == eos
    assert first.stop_reason is None  # the model's own EOS
    ignored = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    longer = llm.generate("Return", ignored, use_tqdm=False)[0].outputs[0]
    assert longer.finish_reason == "length" and len(longer.token_ids) == 60
    listed = SamplingParams(
        max_tokens=60,
        temperature=0,
        ignore_eos=True,
        stop_token_ids=[eos],
        skip_special_tokens=False,
    )
    out = llm.generate("Return", listed, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == eos
    assert out.token_ids == first.token_ids
    assert out.text == first.text and "<eos>" not in out.text
    kept = SamplingParams(
        max_tokens=60,
        temperature=0,
        stop_token_ids=[eos],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    with_eos = llm.generate("Return", kept, use_tqdm=False)[0].outputs[0]
    assert with_eos.text == first.text + "<eos>"

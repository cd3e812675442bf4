"""The engine on a real CUDA GPU (marked `gpu`; `tools/gpu_check.sh` runs these in one go): goldens
against `transformers` on the same GPU in float32 and bfloat16, every scheduling mode giving the
tokens of the synchronous run, offload on vs off giving the same greedy tokens, the race sanitizer
raising on every op. CI has no GPU: these run only where one is lent (see README, "On a GPU")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.model.testing import write_tiny_model
from tests.engine.workloads import mixed_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SMALL = {"max_model_len": 256, "block_size": 4, "max_num_batched_tokens": 64}
CUDA = {"device": "cuda", "sanitize": True, "poison": True}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # fits max_model_len 64


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    return write_tiny_model(tmp_path_factory.mktemp(arch), arch, window=8)


def generate(model: Path, params: SamplingParams = GREEDY, **kw: Any) -> list[list[int]]:
    llm = LLM(str(model), **{**SMALL, **CUDA, **kw})
    outs = llm.generate([{"prompt_token_ids": p} for p in mixed_prompts()], params, use_tqdm=False)
    assert llm.engine.stats().num_hazards == 0
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy(model: Path, dtype: torch.dtype, n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager")
    hf = hf.to("cuda").eval()
    out = []
    with torch.no_grad():
        for p in mixed_prompts():
            ids = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def test_float32_greedy_tokens_match_transformers_on_the_gpu(model: Path) -> None:
    assert generate(model, dtype="float32") == hf_greedy(model, torch.float32, 32)


def test_bfloat16_prompt_logprobs_match_transformers_on_the_gpu(model: Path) -> None:
    """bf16 rounding flips near-ties in long greedy runs; the prompt's logprobs (every position
    of one forward) are compared instead, within bf16's resolution."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(model), **{**SMALL, **CUDA, "dtype": "bfloat16"})
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.bfloat16, attn_implementation="eager"
    ).to("cuda")
    for p in mixed_prompts():
        out = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None
        lps = out.prompt_logprobs
        ours = torch.tensor([lps[i][t] for i, t in enumerate(p) if i])  # type: ignore[index]
        with torch.no_grad():
            logits = hf(torch.tensor([p], device="cuda")).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        torch.testing.assert_close(ours, ref.cpu(), atol=0.1, rtol=0.02)
    assert (
        generate(model, dtype="bfloat16", max_num_seqs=1)[0][:4]
        == hf_greedy(model, torch.bfloat16, 4)[0]
    )


MODES = {
    "async2": {"async_depth": 2},
    "async3": {"async_depth": 3},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "tight-pool-preempts": {
        "num_device_blocks": 70,
        "max_model_len": 64,
        "max_num_batched_tokens": 16,
    },
    "ngram-drafts": {"num_speculative_tokens": 3},
    "chunked-prefill": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_scheduling_mode_gives_the_synchronous_tokens(mode: str, model: Path) -> None:
    """float64: batch shapes pick other GPU kernels, which must not flip a near-tie here."""
    sync = generate(model, SHORT, dtype="float64", async_scheduling=False, max_model_len=64)
    kw = {"max_model_len": 64, **MODES[mode]}
    assert generate(model, SHORT, dtype="float64", **kw) == sync


def test_offload_on_and_off_give_the_same_greedy_tokens(model: Path) -> None:
    tight = {"dtype": "float64", "num_device_blocks": 80, "max_model_len": 64}
    off = [generate(model, SHORT, **tight) for _ in range(2)]
    llm = LLM(str(model), **{**SMALL, **CUDA, **tight, "num_host_blocks": 400})
    batch = [{"prompt_token_ids": p} for p in mixed_prompts()]
    on = [
        [o.outputs[0].token_ids for o in llm.generate(batch, SHORT, use_tqdm=False)]
        for _ in range(2)
    ]
    assert on == off
    m = llm.engine.stats().host_metrics
    assert m is not None and m.num_hit_tokens > 0
    assert llm.engine.stats().num_hazards == 0

"""The two routes of `SparseMoE` give one result: the host's expert-by-expert loop and the dense
route an accelerator takes (every expert on every token under a routing matrix, no host read),
whatever the routing: experts no token chose, one expert taking every token, several chunks."""

from __future__ import annotations

import pytest
import torch

from kvtier.model import hybrid
from kvtier.model.hybrid import SparseMoE, experts_by_expert, experts_dense


def moe(num_experts: int = 6, top_k: int = 2, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    layer = SparseMoE(hidden=16, intermediate=8, num_experts=num_experts, top_k=top_k)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer.double()


def routes(layer: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = layer.router(x).float()
    best, experts = logits.topk(layer.top_k, dim=-1)
    weights = torch.softmax(best, dim=-1).to(x.dtype)
    args = (x, experts, weights, layer.gate_up_proj, layer.down_proj)
    return experts_by_expert(*args), experts_dense(*args)


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
@pytest.mark.parametrize(("num_experts", "top_k"), [(6, 2), (4, 4), (8, 1)])
def test_dense_routing_equals_the_loop(num_tokens: int, num_experts: int, top_k: int) -> None:
    layer = moe(num_experts, top_k)
    x = torch.randn(num_tokens, 16, dtype=torch.float64)
    loop, dense = routes(layer, x)
    torch.testing.assert_close(dense, loop, rtol=1e-12, atol=1e-12)


def test_an_expert_nobody_chose_adds_nothing_and_one_taking_all_is_whole() -> None:
    layer = moe(num_experts=5, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3] = 1.0  # every token with a positive sum picks expert 3
    x = torch.rand(7, 16, dtype=torch.float64) + 0.1
    loop, dense = routes(layer, x)
    torch.testing.assert_close(dense, loop, rtol=1e-12, atol=1e-12)
    g, u = torch.nn.functional.linear(x, layer.gate_up_proj[3]).chunk(2, dim=-1)
    alone = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, layer.down_proj[3])
    torch.testing.assert_close(dense, alone, rtol=1e-12, atol=1e-12)


def test_the_dense_route_in_several_token_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = moe()
    monkeypatch.setattr(hybrid, "DENSE_CHUNK_ELEMENTS", 6 * 16 * 5)  # 5 tokens per chunk
    x = torch.randn(23, 16, dtype=torch.float64)
    loop, dense = routes(layer, x)
    torch.testing.assert_close(dense, loop, rtol=1e-12, atol=1e-12)


def test_the_host_takes_the_loop_and_a_device_the_dense_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer, x = moe(), torch.randn(4, 16, dtype=torch.float64)
    taken = []
    for name in ("experts_by_expert", "experts_dense"):
        real = getattr(hybrid, name)
        monkeypatch.setattr(hybrid, name, lambda *a, _n=name, _r=real: taken.append(_n) or _r(*a))
    layer(x)
    monkeypatch.setattr(hybrid, "HOST", torch.device("meta"))  # x is now "not on the host"
    layer(x)
    assert taken == ["experts_by_expert", "experts_dense"]

"""kvtier: a compact LLM inference engine with a paged, hybrid, tiered KV cache."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`from kvtier import LLM, SamplingParams` as with vLLM (loaded on first use)."""
    if name in ("LLM", "SamplingParams", "EngineArgs"):
        import kvtier.engine

        return getattr(kvtier.engine, name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")

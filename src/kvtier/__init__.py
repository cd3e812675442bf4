"""kvtier: a compact LLM inference engine with a paged, hybrid, tiered KV cache."""

__version__ = "0.1.0"

"""Prompts shared by the engine tests: a shared prefix (prefix hits, host-tier reloads), a short and
a long prompt, and a repetitive one on which n-gram drafts get accepted."""

from __future__ import annotations


def mixed_prompts() -> list[list[int]]:
    shared = [(7 * i) % 300 + 3 for i in range(20)]
    return [
        [*shared, 11, 12, 13],
        [*shared, 21, 22],
        list(range(40, 45)),
        [(5 * i) % 251 + 3 for i in range(37)],
        [*shared[:9], 5, 5, 5, 5, 5, 5, 5, 5],  # repetitive: n-gram drafts get accepted
    ]

"""Prompt-lookup (n-gram) draft proposer: host-side, no model, no torch.

Finds the latest earlier occurrence of the sequence's last n tokens and proposes what followed it.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """Propose up to `k` drafts by matching the last `max_n` … `min_n` tokens earlier in the text.

    Only the last `max_lookback` tokens are searched, bounding host time per request.
    """

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3, max_lookback: int = 1024) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be ≥ 1 for n-gram drafts, got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 ≤ min_n ≤ max_n, got {min_n}, {max_n}")
        if max_lookback <= max_n:
            raise ValueError(f"max_lookback must exceed max_n={max_n}, got {max_lookback}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self.max_lookback = max_lookback

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default self.k) draft ids continuing `token_ids`; [] if nothing matches."""
        k = self.k if k is None else min(k, self.k)
        if k <= 0:
            return []
        text = list(token_ids[-self.max_lookback :])
        num = len(text)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            pattern = text[num - n :]
            # Latest match whose continuation starts before the pattern itself.
            for start in range(num - n - 1, -1, -1):
                if text[start : start + n] == pattern:
                    return text[start + n : start + n + k]
        return []

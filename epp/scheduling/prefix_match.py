"""What a prefix-cache producer tells the scorers: how much of this prompt each endpoint holds.

Two producers write it — `approx-prefix-cache-producer` (from where the EPP sent prompts) and
`precise-prefix-cache-producer` (from the engines' own KV events) — and every consumer reads
only this type: `prefix-cache-scorer` (matched / total blocks) and the predicted-latency
scorer's cache credit (matched tokens are prefill a pod need not compute).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixMatch:
    """One request's prefix lookup, left in the cycle state under its producer's name."""

    total: int  # the prompt's blocks (as the producer cuts them)
    block_size_tokens: int
    matched: dict[str, int]  # endpoint address -> leading blocks it holds
    hashes: list[int] = field(default_factory=list)  # the producer's own block keys, if it keeps them
    # Prompt tokens per block when blocks are not cut in tokens (the approximate producer cuts
    # characters); 0: `block_size_tokens`.
    tokens_per_block: float = 0.0

    def tokens(self, address: str) -> int:
        """Prompt tokens `address` is believed to hold (its matched blocks × tokens per block)."""
        return int(self.matched.get(address, 0) * (self.tokens_per_block or self.block_size_tokens))

    def ratio(self, address: str) -> float:
        return self.matched.get(address, 0) / self.total if self.total else 0.0

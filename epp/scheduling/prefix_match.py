"""What a prefix-cache producer tells the scorers: how much of this prompt each endpoint holds.

Two producers write it — `approx-prefix-cache-producer` (from where the EPP sent prompts) and
`precise-prefix-cache-producer` (from the engines' own KV events) — and every consumer reads
only this type: `prefix-cache-scorer` (matched / total blocks) and the predicted-latency
scorer's cache credit (matched tokens are prefill a pod need not compute).

The precise producer also says, per endpoint, where the number came from (`sources`: "precise"
from events, "approximate" for endpoints that publish none) and, for blocks held off the GPU
(CPU offload), their tier-weighted credit (`weighted`); a producer that leaves them empty means
"all precise-or-approximate alike, all on the fastest tier", so older consumers read it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SOURCE_PRECISE = "precise"
SOURCE_APPROXIMATE = "approximate"


@dataclass(slots=True)
class PrefixMatch:
    """One request's prefix lookup, left in the cycle state under its producer's name."""

    total: int  # the prompt's blocks (as the producer cuts them)
    block_size_tokens: int
    matched: dict[str, int]  # endpoint address -> leading blocks it holds (any tier)
    hashes: list[int] = field(default_factory=list)  # the producer's own block keys, if it keeps them
    # Prompt tokens per block when blocks are not cut in tokens (the approximate producer cuts
    # characters); 0: `block_size_tokens`.
    tokens_per_block: float = 0.0
    # -- optional, written by the precise producer --
    weighted: dict[str, float] = field(default_factory=dict)  # address -> tier-weighted blocks (when < matched)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # address -> {tier: blocks} held off the GPU
    sources: dict[str, str] = field(default_factory=dict)  # address -> SOURCE_PRECISE | SOURCE_APPROXIMATE
    note: str = ""  # why the producer fell back, for the decision trace
    # address -> cached prompt tokens this request's new blocks would evict there (its cache is
    # believed full); absent: room left, or unknown.
    evicted_tokens: dict[str, int] = field(default_factory=dict)
    # address -> the share of its matched blocks the endpoint is expected to compute again before
    # this request runs there (the prefixes of its requests in flight outgrow its cache); absent: none.
    recompute_share: dict[str, float] = field(default_factory=dict)

    def tokens(self, address: str) -> int:
        """Prompt tokens of cache credit on `address`: its tier-weighted matched blocks × tokens
        per block (a block offloaded to CPU saves less than one on the GPU)."""
        return int(self.credit(address) * (self.tokens_per_block or self.block_size_tokens))

    def credit(self, address: str) -> float:
        """Matched blocks weighted by tier (equal to `matched` when everything is on the GPU)."""
        weighted = self.weighted.get(address)
        return weighted if weighted is not None else float(self.matched.get(address, 0))

    def ratio(self, address: str) -> float:
        return self.credit(address) / self.total if self.total else 0.0


def held_tokens(data: Mapping[str, object], address: str) -> int:
    """Prompt tokens the cycle's prefix producers believe (the largest claim, when two run) `address`
    holds: what a request sent there need not prefill."""
    return max((m.tokens(address) for m in data.values() if isinstance(m, PrefixMatch)), default=0)

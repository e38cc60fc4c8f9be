"""One request as the engine sees it: token counts, block hashes, state and timestamps.

The engine's per-step work needs only token counts and the chained hashes of the full prompt
blocks (for prefix caching), so per-step work per request stays O(1); the prompt's token ids ride
along for the KV events a real server publishes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import IntEnum

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class Request:
    """A generation request and its engine-side state (times are engine-clock seconds)."""

    request_id: str
    prompt_len: int
    # Chained hashes of the prompt's full blocks; output blocks are appended as they fill.
    block_hashes: list[int]
    # The request's token limit and the length at which it ends (<= max_tokens; == means "length").
    max_tokens: int
    output_len: int
    arrival_time: float
    priority: int = 0
    lora: str | None = None
    # Distinguishes this request's output blocks from every other request's in the prefix cache.
    salt: int = 0
    # The prompt's token ids (what KV events publish per stored block); None for requests built
    # from bare sizes or counted text. Given ids, `block_hashes` come from them, vLLM's way
    # (`block_hash.hash_blocks`, with `lora` and `cache_salt`); an engine fills them in if empty.
    # Without ids the hashes know nothing of `cache_salt`, so the engine mixes it in on arrival.
    prompt_token_ids: array | None = None
    # vLLM's `cache_salt`: only requests with the same salt share cached blocks.
    cache_salt: str | None = None
    # `block_hashes` are final (`kv_cache.prepare_block_hashes` ran).
    hashes_prepared: bool = False
    # Free slot for the caller (e.g. the HTTP stream waiting on this request); the engine ignores it.
    user_data: object = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    # Tokens scheduled in the step in flight (set by schedule, consumed by update).
    num_scheduled_tokens: int = 0
    # Prefix-cache hit tokens at first admission (-1 until admitted).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Physical KV block ids held, in token order (the KV cache's; see kv_cache.py).
    blocks: list[int] = field(default_factory=list)
    # Leading blocks already entered into the prefix cache (vLLM's `num_cached_block`).
    num_cached_blocks: int = 0
    # Computed tokens the blocks hold with no work for the KV cache (no new block, none filled):
    # the engine's per-step fast path (set by the KV cache).
    kv_fast_until: int = -1
    finish_reason: str | None = None
    seq: int = 0

    first_scheduled_time: float = -1.0
    first_token_time: float = -1.0
    last_token_time: float = -1.0
    # Gap between the last two tokens (for the inter-token latency histogram).
    last_itl: float = 0.0
    finish_time: float = -1.0
    token_times: array | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what a recompute after preemption must prefill."""
        return self.prompt_len + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def ttft(self) -> float:
        """Time to first token (arrival to first token), or -1 before the first token."""
        return self.first_token_time - self.arrival_time if self.first_token_time >= 0 else -1.0

    @property
    def e2e(self) -> float:
        """Arrival to finish, or -1 while unfinished."""
        return self.finish_time - self.arrival_time if self.finish_time >= 0 else -1.0

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for single-token outputs)."""
        if self.num_output_tokens < 2:
            return 0.0
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    def itls(self) -> list[float]:
        """Inter-token latencies (needs EngineConfig.record_token_times)."""
        t = self.token_times
        if t is None:
            return []
        return [t[i] - t[i - 1] for i in range(1, len(t))]

"""What the EPP learns per model from the responses it sees: how many characters a prompt token
is, and how long outputs are when a request does not say.

The prefix hasher and the ledger count prompts in characters until they know better; a model's
own tokenizer may average 3 or 5 characters per token, which moves every prefill estimate by as
much. Each served request with `usage` corrects both numbers (exponential averages, bounded).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CHARS_PER_TOKEN = 4.0  # the reference's estimate, until a response says otherwise
DEFAULT_OUTPUT_TOKENS = 256.0
DEFAULT_PROMPT_TOKENS = 512.0
_MAX_MODELS = 64  # model names come from clients: a bounded table
_MIN_SAMPLES = 8  # responses before the learned numbers are trusted


@dataclass(slots=True)
class ModelStats:
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    mean_output_tokens: float = DEFAULT_OUTPUT_TOKENS
    mean_prompt_tokens: float = DEFAULT_PROMPT_TOKENS
    samples: int = 0

    def expected_output(self, max_tokens: int | None) -> int:
        """Tokens a request will generate: the learned mean, capped by its `max_tokens` (which is
        usually a generous limit, not a length); `max_tokens` alone until there are samples."""
        if max_tokens is not None and max_tokens > 0:
            if self.samples < _MIN_SAMPLES:
                return max_tokens
            return max(1, min(max_tokens, int(self.mean_output_tokens)))
        return max(1, int(self.mean_output_tokens))

    def prompt_tokens(self, prompt_chars: int) -> int:
        return max(1, int(prompt_chars / self.chars_per_token))

    def observe(self, prompt_chars: int, prompt_tokens: int, output_tokens: int) -> None:
        alpha = max(0.02, 1.0 / (self.samples + 1))  # a plain mean at first, then an EWMA
        if prompt_tokens > 0 and prompt_chars > 0:
            ratio = min(16.0, max(0.5, prompt_chars / prompt_tokens))
            self.chars_per_token += alpha * (ratio - self.chars_per_token)
            self.mean_prompt_tokens += alpha * (min(prompt_tokens, 1 << 20) - self.mean_prompt_tokens)
        if output_tokens >= 0:
            self.mean_output_tokens += alpha * (min(output_tokens, 1 << 20) - self.mean_output_tokens)
        self.samples += 1


class ModelStatsTable:
    """Per target model; the least recently seen model leaves when the table is full."""

    __slots__ = ("_stats",)

    def __init__(self) -> None:
        self._stats: OrderedDict[str, ModelStats] = OrderedDict()

    def get(self, model: str) -> ModelStats:
        stats = self._stats.get(model)
        if stats is None:
            stats = self._stats[model] = ModelStats()
            if len(self._stats) > _MAX_MODELS:
                self._stats.popitem(last=False)
        else:
            self._stats.move_to_end(model)
        return stats

    def __len__(self) -> int:
        return len(self._stats)

"""What the EPP learns per model from the responses it sees: how many characters a prompt token
is, and how long outputs are when a request does not say.

The prefix hasher and the ledger count prompts in characters until they know better; a model's
own tokenizer may average 3 or 5 characters per token, which moves every prefill estimate by as
much. Each served request with `usage` corrects both numbers (exponential averages, bounded).

A request's `max_tokens` is sometimes a length (benchmarks, `ignore_eos`, clients that know) and
usually a generous limit. Which one a model's clients mean is learned, not assumed: the share of
responses that ran to their `max_tokens` (`at_limit`). A request then expects
`at_limit × max_tokens + (1 − at_limit) × min(max_tokens, mean output of those that stopped
earlier)` — the mean of a natural length cut at the limit, plus the runs that reach it.
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
    at_limit: float = 0.0  # share of responses with a max_tokens that generated all of it
    mean_free_output: float = DEFAULT_OUTPUT_TOKENS  # mean output of those that stopped earlier
    limited_samples: int = 0
    free_samples: int = 0

    def expected_output(self, max_tokens: int | None, room: int = 0) -> int:
        """Tokens a request will generate (see the module docstring); `max_tokens` alone until
        there are samples. At most `room` when it is given (> 0): what the engine's longest
        sequence leaves after the prompt (`longest_sequence`; vLLM stops the output there)."""
        if room > 0:
            if max_tokens is not None and max_tokens > room:
                max_tokens = room  # the engine's limit is the one that binds
            return min(room, self.expected_output(max_tokens))
        if max_tokens is not None and max_tokens > 0:
            if self.limited_samples < _MIN_SAMPLES:
                return max_tokens
            free = self.mean_free_output if self.free_samples else self.mean_output_tokens
            p = self.at_limit
            return max(1, int(p * max_tokens + (1.0 - p) * min(max_tokens, free)))
        return max(1, int(self.mean_output_tokens))

    def length_certainty(self, max_tokens: int | None) -> float:
        """How surely a request's expected output is its length: the share of responses that ran
        to their `max_tokens` (1 until there are samples, as `expected_output` assumes); 0 without
        one (a learned mean is no length)."""
        if max_tokens is None or max_tokens <= 0:
            return 0.0
        return self.at_limit if self.limited_samples >= _MIN_SAMPLES else 1.0

    def prompt_tokens(self, prompt_chars: int) -> int:
        return max(1, int(prompt_chars / self.chars_per_token))

    def observe(self, prompt_chars: int, prompt_tokens: int, output_tokens: int,
                max_tokens: int | None = None) -> None:
        alpha = _alpha(self.samples)
        if prompt_tokens > 0 and prompt_chars > 0:
            ratio = min(16.0, max(0.5, prompt_chars / prompt_tokens))
            self.chars_per_token += alpha * (ratio - self.chars_per_token)
            self.mean_prompt_tokens += alpha * (min(prompt_tokens, 1 << 20) - self.mean_prompt_tokens)
        if output_tokens >= 0:
            output = min(output_tokens, 1 << 20)
            self.mean_output_tokens += alpha * (output - self.mean_output_tokens)
            reached = False  # generated all of its max_tokens (those are no sample of a natural length)
            if max_tokens is not None and max_tokens > 0:
                reached = output >= max_tokens
                self.at_limit += _alpha(self.limited_samples) * ((1.0 if reached else 0.0) - self.at_limit)
                self.limited_samples += 1
            if not reached:
                self.mean_free_output += _alpha(self.free_samples) * (output - self.mean_free_output)
                self.free_samples += 1
        self.samples += 1


def _alpha(samples: int) -> float:
    """A plain mean at first, then an exponential average."""
    return max(0.02, 1.0 / (samples + 1))


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

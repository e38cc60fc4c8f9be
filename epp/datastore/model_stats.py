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

Output lengths are also learned per flow (the fairness ID a request carries: a tenant, an
application), since one model serves clients whose answers differ by ten times — a chat's 150
tokens beside a batch job's 1,000 — and a model's mean prices both wrong: the batch job's decode,
slot and KV stay at a seventh of what it holds. A flow's own numbers are used once it has
`_MIN_SAMPLES` responses (`ModelStatsTable.output_stats`); until then the model's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

DEFAULT_CHARS_PER_TOKEN = 4.0  # the reference's estimate, until a response says otherwise
DEFAULT_OUTPUT_TOKENS = 256.0
DEFAULT_PROMPT_TOKENS = 512.0
_MAX_MODELS = 64  # model names come from clients: a bounded table
_MAX_FLOWS = 4096  # so are flow IDs: the least recently seen (model, flow) leaves first
_MAX_FLOW_CHARS = 256  # a longer flow ID is not learned (its requests get the model's numbers)
_MIN_SAMPLES = 8  # responses before the learned numbers are trusted

K = TypeVar("K")


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
    """Per target model, and per (model, flow) for output lengths; in each, the least recently
    seen entry leaves when the table is full."""

    __slots__ = ("_stats", "_flows")

    def __init__(self) -> None:
        self._stats: OrderedDict[str, ModelStats] = OrderedDict()
        self._flows: OrderedDict[tuple[str, str], ModelStats] = OrderedDict()

    def get(self, model: str) -> ModelStats:
        return _lookup(self._stats, model, _MAX_MODELS)

    def output_stats(self, model: str, flow: str) -> ModelStats:
        """Whose numbers say how long this request's output will be (`expected_output`,
        `length_certainty`): its flow's once that has `_MIN_SAMPLES` responses, else its model's."""
        stats = self._flows.get((model, flow))
        if stats is not None and stats.samples >= _MIN_SAMPLES:
            self._flows.move_to_end((model, flow))
            return stats
        return self.get(model)

    def observe(self, model: str, flow: str, prompt_chars: int, prompt_tokens: int, output_tokens: int,
                max_tokens: int | None = None) -> None:
        """A served response's usage, learned for its model and its flow."""
        self.get(model).observe(prompt_chars, prompt_tokens, output_tokens, max_tokens)
        if len(flow) <= _MAX_FLOW_CHARS:  # (a header's worth of ID, times 4,096 entries, is memory)
            _lookup(self._flows, (model, flow), _MAX_FLOWS).observe(prompt_chars, prompt_tokens, output_tokens,
                                                                    max_tokens)

    def __len__(self) -> int:
        return len(self._stats)

    def flows(self) -> int:
        return len(self._flows)


def _lookup(table: OrderedDict[K, ModelStats], key: K, limit: int) -> ModelStats:
    stats = table.get(key)
    if stats is None:
        stats = table[key] = ModelStats()
        if len(table) > limit:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return stats

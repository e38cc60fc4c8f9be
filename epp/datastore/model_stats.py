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
Output lengths are learned per InferenceObjective too, and a request of an objective with enough
responses expects its objective's: a pool's objectives are its classes of traffic (chat beside
batch jobs), and a pod's KV and batch slots fill by what its requests will really generate.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_CHARS_PER_TOKEN = 4.0  # the reference's estimate, until a response says otherwise
DEFAULT_OUTPUT_TOKENS = 256.0
DEFAULT_PROMPT_TOKENS = 512.0
_MAX_MODELS = 64  # model names come from clients: a bounded table
_MIN_SAMPLES = 8  # responses before the learned numbers are trusted
_MAX_OBJECTIVES = 32  # per model (objectives are cluster objects, few; a bound all the same)


@dataclass(slots=True)
class OutputLengths:
    """How long the outputs of one class of requests run (a model's, or one objective's of it)."""

    mean_output_tokens: float = DEFAULT_OUTPUT_TOKENS
    at_limit: float = 0.0  # share of responses with a max_tokens that generated all of it
    mean_free_output: float = DEFAULT_OUTPUT_TOKENS  # mean output of those that stopped earlier
    samples: int = 0
    limited_samples: int = 0
    free_samples: int = 0

    def expected(self, max_tokens: int | None) -> int:
        """Tokens a request will generate (see the module docstring); `max_tokens` alone until
        there are samples."""
        if max_tokens is not None and max_tokens > 0:
            if self.limited_samples < _MIN_SAMPLES:
                return max_tokens
            free = self.mean_free_output if self.free_samples else self.mean_output_tokens
            p = self.at_limit
            return max(1, int(p * max_tokens + (1.0 - p) * min(max_tokens, free)))
        return max(1, int(self.mean_output_tokens))

    def certainty(self, max_tokens: int | None) -> float:
        """How surely a request's expected output is its length: the share of responses that ran
        to their `max_tokens` (1 until there are samples, as `expected` assumes); 0 without
        one (a learned mean is no length)."""
        if max_tokens is None or max_tokens <= 0:
            return 0.0
        return self.at_limit if self.limited_samples >= _MIN_SAMPLES else 1.0

    def observe(self, output_tokens: int, max_tokens: int | None) -> None:
        output = min(output_tokens, 1 << 20)
        self.mean_output_tokens += _alpha(self.samples) * (output - self.mean_output_tokens)
        self.samples += 1
        if max_tokens is not None and max_tokens > 0:
            reached = output >= max_tokens
            self.at_limit += _alpha(self.limited_samples) * ((1.0 if reached else 0.0) - self.at_limit)
            self.limited_samples += 1
            if reached:
                return
        self.mean_free_output += _alpha(self.free_samples) * (output - self.mean_free_output)
        self.free_samples += 1


@dataclass(slots=True)
class ModelStats:
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    mean_prompt_tokens: float = DEFAULT_PROMPT_TOKENS
    samples: int = 0
    outputs: OutputLengths = field(default_factory=OutputLengths)  # every request of the model
    # Per InferenceObjective (known ones only: the caller checks), once it has its own samples:
    # a pool's objectives are its classes of traffic, and their lengths differ by design
    # (interactive chat beside batch jobs ten times as long).
    by_objective: dict[str, OutputLengths] = field(default_factory=dict)

    @property
    def mean_output_tokens(self) -> float:
        return self.outputs.mean_output_tokens

    @property
    def at_limit(self) -> float:
        return self.outputs.at_limit

    def lengths(self, objective: str = "") -> OutputLengths:
        """The objective's output lengths once it has `_MIN_SAMPLES` responses, else the model's."""
        own = self.by_objective.get(objective) if objective else None
        return own if own is not None and own.samples >= _MIN_SAMPLES else self.outputs

    def expected_output(self, max_tokens: int | None, objective: str = "") -> int:
        return self.lengths(objective).expected(max_tokens)

    def length_certainty(self, max_tokens: int | None, objective: str = "") -> float:
        return self.lengths(objective).certainty(max_tokens)

    def prompt_tokens(self, prompt_chars: int) -> int:
        return max(1, int(prompt_chars / self.chars_per_token))

    def observe(self, prompt_chars: int, prompt_tokens: int, output_tokens: int,
                max_tokens: int | None = None, objective: str = "") -> None:
        alpha = _alpha(self.samples)
        if prompt_tokens > 0 and prompt_chars > 0:
            ratio = min(16.0, max(0.5, prompt_chars / prompt_tokens))
            self.chars_per_token += alpha * (ratio - self.chars_per_token)
            self.mean_prompt_tokens += alpha * (min(prompt_tokens, 1 << 20) - self.mean_prompt_tokens)
        if output_tokens >= 0:
            self.outputs.observe(output_tokens, max_tokens)
            if objective:
                own = self.by_objective.get(objective)
                if own is None and len(self.by_objective) < _MAX_OBJECTIVES:
                    own = self.by_objective[objective] = OutputLengths()
                if own is not None:
                    own.observe(output_tokens, max_tokens)
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

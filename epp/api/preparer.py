"""Request preparation: async work that runs once per request before admission and scheduling.

Scheduling must never do I/O or long CPU work, yet some of what it reads needs both (a prompt's
token ids, from a local tokenizer or the model server's `/tokenize` endpoint). A `RequestPreparer`
does that work first, bounded by its own `timeout`, and leaves the result in `request.state`
under a key of its own; the scheduling plugins read it there. A preparer that fails or times out
leaves nothing, and its readers fall back (the precise prefix producer to the approximate index).

The director calls every configured preparer at the start of `handle_request`, in config order.
"""

from __future__ import annotations

from abc import abstractmethod
from array import array
from dataclasses import dataclass

# TOKENIZED_PROMPT is defined beside the request, which drops it with its payload after the pick.
from epp.api.request import TOKENIZED_PROMPT, InferenceRequest  # noqa: F401 (re-exported)
from epp.plugin import Plugin


class RequestPreparer(Plugin):
    """A plugin with an async step before admission (e.g. `token-producer`)."""

    timeout: float = 1.0  # seconds; the director abandons the step after this

    @abstractmethod
    async def prepare_request(self, request: InferenceRequest) -> None:
        """Compute what the scheduling plugins need and store it in `request.state`."""


@dataclass(slots=True)
class TokenizedPrompt:
    """The prompt's token ids as the engine will see them, and what keys its cache blocks."""

    ids: array  # uint32 ("I") token ids
    lora_name: str = ""  # the adapter the engine keys the blocks with ("" for the base model)
    cache_salt: str = ""
    source: str = "local"  # "local" | "vllm" (which backend produced the ids)
    cached_chars: int = 0  # how much of the text came from the tokenization cache
    # The tokenization cache's ids for this prompt and for the cached prompt it extended, whose
    # first `shared_tokens` ids it repeats: lets a reader reuse work it did for that prompt.
    serial: int = 0
    prefix_serial: int = 0
    shared_tokens: int = 0

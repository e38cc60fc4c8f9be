"""The request APIs the EPP parses, how a path selects one, and what every parser extracts.

OpenAI's APIs are chosen by path suffix, as the reference's `openai-parser` does (unknown paths
are completions). The engines' native APIs add three: TGI's `/generate` and `/generate_stream`
and SGLang's `/generate`. TGI and SGLang share the `/generate` path, so the path gives only
`Api.GENERATE` and the body decides (`inputs` is TGI, `text`/`input_ids`/`input_embeds` SGLang).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from epp.api.engines import SGLANG, TGI
from epp.errors import Code, EppError


class Api(str, enum.Enum):
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat/completions"
    RESPONSES = "responses"
    CONVERSATIONS = "conversations"
    EMBEDDINGS = "embeddings"
    GENERATE = "generate"  # the `/generate` path before the body says whose API it is
    TGI_GENERATE = "tgi/generate"
    TGI_GENERATE_STREAM = "tgi/generate_stream"
    SGLANG_GENERATE = "sglang/generate"

    @property
    def engines(self) -> frozenset[str] | None:
        """The engines that serve this API; None: any (the OpenAI APIs every engine speaks)."""
        return _NATIVE_ENGINES.get(self)

    @property
    def native(self) -> bool:
        return self in _NATIVE_ENGINES


_NATIVE_ENGINES: dict[Api, frozenset[str]] = {
    Api.GENERATE: frozenset({TGI, SGLANG}),
    Api.TGI_GENERATE: frozenset({TGI}),
    Api.TGI_GENERATE_STREAM: frozenset({TGI}),
    Api.SGLANG_GENERATE: frozenset({SGLANG}),
}

# Longest suffix first, so "/chat/completions" is not taken for "/completions".
_PATH_SUFFIXES: tuple[tuple[str, Api], ...] = (
    ("/chat/completions", Api.CHAT_COMPLETIONS),
    ("/completions", Api.COMPLETIONS),
    ("/responses", Api.RESPONSES),
    ("/conversations", Api.CONVERSATIONS),
    ("/embeddings", Api.EMBEDDINGS),
    ("/generate_stream", Api.TGI_GENERATE_STREAM),
    ("/generate", Api.GENERATE),
)


def api_for_path(path: str) -> Api:
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in _PATH_SUFFIXES:
        if path.endswith(suffix):
            return api
    return Api.COMPLETIONS


@dataclass(slots=True)
class BodyFields:
    """What an API parser reads from a validated body, whatever the API."""

    api: Api
    model: str  # the name the request is accounted and labelled under
    prompt: bytes  # what prefix affinity hashes
    stream: bool
    max_tokens: int | None
    cache_salt: str = ""
    rewritable: bool = True  # the body has a `model` field a rewrite can set


def bad_request(message: str) -> EppError:
    return EppError(Code.BAD_REQUEST, message, reason="bad_request")


# The most output tokens a request is accounted for (a larger limit counts as this): as much as
# the longest context windows served hold, and a bound on what one client's number can do to a
# pod's in-flight tokens, its ledger's KV forecast and the prefix index's idea of its cache.
MAX_OUTPUT_TOKENS = 1 << 20


def token_count(value: object) -> int | None:
    """A token limit the EPP can account: a non-negative JSON integer (not a bool), at most
    `MAX_OUTPUT_TOKENS`; else None. A limit of the wrong type or sign is the engine's to reject
    (the body goes on as sent): counted, a negative one left the pod's in-flight tokens above
    zero once requests there had ended out of order."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value if value <= MAX_OUTPUT_TOKENS else MAX_OUTPUT_TOKENS
    return None

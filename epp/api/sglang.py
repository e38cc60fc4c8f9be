"""SGLang's native API: `POST /generate` with `text`, `input_ids` or `input_embeds`.

The body is SGLang's `GenerateReqInput` (python/sglang/srt/managers/io_struct.py): exactly one of
`text` (a string, or a list for a batch), `input_ids` (token ids, or a list of lists) and
`input_embeds`; `sampling_params` (an object, or one per batch item) with `max_new_tokens`;
`stream`; `lora_path` names a LoRA adapter.

There is no `model` field: a request is accounted under its `lora_path` when it names one, else
under "sglang", and a model rewrite cannot apply. `input_embeds` carries no text to hash, so
such a request gets no prefix affinity.
"""

from __future__ import annotations

from typing import Any

import orjson

from epp.api.apis import Api, BodyFields, bad_request, token_count
from epp.api.engines import SGLANG

BASE_MODEL = SGLANG
INPUT_FIELDS = ("text", "input_ids", "input_embeds")


def _prompt(body: dict[str, Any]) -> tuple[bytes, int]:
    """(bytes to hash, number of prompts in the batch), validating the one input given."""
    text = body.get("text")
    if text is not None:
        if isinstance(text, str) and text:
            return text.encode(), 1
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return " ".join(text).encode(), len(text)
        raise bad_request("invalid SGLang generate request: text must be a non-empty string or list of strings")
    # Token ids and embeddings are checked for shape only (a batch is a list of lists): the
    # element types are the engine's to validate, and a per-token loop has no place here.
    ids = body.get("input_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise bad_request("invalid SGLang generate request: input_ids must be a non-empty list of token ids")
        return orjson.dumps(ids), len(ids) if isinstance(ids[0], list) else 1
    embeds = body.get("input_embeds")
    if not isinstance(embeds, list) or not embeds:
        raise bad_request("invalid SGLang generate request: input_embeds must be a non-empty list")
    batched = isinstance(embeds[0], list) and bool(embeds[0]) and isinstance(embeds[0][0], list)
    return b"", len(embeds) if batched else 1


def _max_tokens(sampling: Any, batch: int) -> int | None:
    """Output tokens the whole request may produce: one `max_new_tokens` per prompt."""
    if sampling is None:
        return None
    if isinstance(sampling, dict):
        per_prompt = token_count(sampling.get("max_new_tokens"))
        return None if per_prompt is None else token_count(per_prompt * batch)
    if isinstance(sampling, list) and all(isinstance(s, dict) for s in sampling):
        limits = [token_count(s.get("max_new_tokens")) for s in sampling]
        return None if not limits or None in limits else token_count(sum(limits))  # type: ignore[arg-type]
    raise bad_request("invalid SGLang generate request: sampling_params must be an object or a list of objects")


def parse_sglang(body: dict[str, Any]) -> BodyFields:
    """Validate an SGLang `GenerateReqInput` body; raises `EppError` (400) with a clear message."""
    given = [name for name in INPUT_FIELDS if body.get(name) is not None]
    if not given:
        raise bad_request("invalid SGLang generate request: must have a text, input_ids or input_embeds field")
    if len(given) > 1:
        raise bad_request(f"invalid SGLang generate request: give only one of {', '.join(given)}")
    prompt, batch = _prompt(body)
    lora = body.get("lora_path")
    salt = body.get("cache_salt")
    return BodyFields(
        api=Api.SGLANG_GENERATE,
        model=lora if isinstance(lora, str) and lora else BASE_MODEL,
        prompt=prompt,
        stream=body.get("stream") is True,
        max_tokens=_max_tokens(body.get("sampling_params"), batch),
        cache_salt=salt if isinstance(salt, str) else "",
        rewritable=False,
    )

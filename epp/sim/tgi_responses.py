"""TGI 3.3's response bodies, SSE events and headers (router/src/lib.rs, server.rs, chat.rs).

Key order follows the Rust structs' field order (serde serialises in declaration order); fields
TGI skips when empty (`top_tokens`, `best_of_sequences`) are left out. SSE events are axum's:
`data:` with no space, then a blank line.
"""

from __future__ import annotations

from typing import Any

import orjson

from epp.sim.generation import token_ids, token_piece
from epp.sim.request import FINISH_LENGTH
from epp.sim.tokens import Tokenizer
from epp.sim.tgi_exposition import rust_float

VERSION = "3.3.6-dev0"
ROUTER = "text-generation-router"
SYSTEM_FINGERPRINT = f"{VERSION}-native"
COMPUTE_TYPE = "gpu+optimized"  # the COMPUTE_TYPE default (server.rs)
DONE = b"data:[DONE]\n\n"
LOGPROB = -0.25  # the simulator does not model probabilities


def finish_reason(reason: str | None) -> str:
    """TGI's names: `length`, `eos_token` (the simulated end of sequence), `stop_sequence`."""
    return "length" if reason == FINISH_LENGTH else "eos_token"


def chat_finish_reason(reason: str | None) -> str:
    """`FinishReason::format(true)`: the Messages API says `stop` for an end-of-sequence token."""
    return "length" if reason == FINISH_LENGTH else "stop"


def token(salt: int, i: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """Generated token `i` of the request with this salt, with the pod tokenizer's id for it."""
    text = token_piece(salt, i, tokenizer.output_vocab)
    tid = token_ids(salt, i, i + 1, tokenizer.output_ids)[0]
    return {"id": int(tid), "text": text, "logprob": LOGPROB, "special": False}


def generate_body(text: str, details: dict[str, Any] | None) -> bytes:
    """`GenerateResponse`: `details` only when the client asked for them."""
    body: dict[str, Any] = {"generated_text": text}
    if details is not None:
        body["details"] = details
    return orjson.dumps(body)


def details(reason: str | None, generated: int, seed: int | None, salt: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """`Details` of a /generate answer (`prefill` is filled only with decoder_input_details,
    which the simulator leaves empty: it does not model prompt logprobs)."""
    return {"finish_reason": finish_reason(reason), "generated_tokens": generated, "seed": seed,
            "prefill": [], "tokens": [token(salt, i, tokenizer) for i in range(generated)]}


def stream_event(index: int, tok: dict[str, Any], generated_text: str | None,
                 stream_details: dict[str, Any] | None) -> bytes:
    return b"data:" + orjson.dumps({"index": index, "token": tok, "generated_text": generated_text,
                                    "details": stream_details}) + b"\n\n"


def stream_details(reason: str | None, generated: int, seed: int | None, input_length: int) -> dict[str, Any]:
    return {"finish_reason": finish_reason(reason), "generated_tokens": generated, "seed": seed,
            "input_length": input_length}


def error_event(error: str, error_type: str) -> bytes:
    return b"data:" + orjson.dumps({"error": error, "error_type": error_type}) + b"\n\n"


def chat_error_event(message: str) -> bytes:
    """`InferError::into_openai_event`: errors inside a chat stream."""
    return b"data:" + orjson.dumps({"error": {"message": message, "http_status_code": 422}}) + b"\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_body(created: int, model: str, text: str, reason: str | None, prompt: int, completion: int) -> bytes:
    return orjson.dumps({
        "object": "chat.completion", "id": "", "created": created, "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": chat_finish_reason(reason)}],
        "usage": _usage(prompt, completion),
    })


def chat_chunk(created: int, model: str, text: str, reason: str | None) -> bytes:
    return b"data:" + orjson.dumps({
        "object": "chat.completion.chunk", "id": "", "created": created, "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": None if reason is None else chat_finish_reason(reason)}],
        "usage": None,
    }) + b"\n\n"


def chat_usage_chunk(created: int, model: str, prompt: int, completion: int) -> bytes:
    return b"data:" + orjson.dumps({
        "object": "chat.completion.chunk", "id": "", "created": created, "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": _usage(prompt, completion),
    }) + b"\n\n"


def completion_body(created: int, model: str, text: str, reason: str | None, prompt: int, completion: int) -> bytes:
    """`Completion::Final` (`object` first); non-streamed, the finish reason is `format(true)`."""
    return orjson.dumps({
        "object": "text_completion", "id": "", "created": created, "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": chat_finish_reason(reason)}],
        "usage": _usage(prompt, completion),
    })


def completion_chunk(created: int, model: str, text: str) -> bytes:
    """`Completion::Chunk`: every streamed token but the last (an empty finish reason)."""
    return b"data:" + orjson.dumps({
        "object": "text_completion", "id": "", "created": created,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": ""}],
        "model": model, "system_fingerprint": SYSTEM_FINGERPRINT,
    }) + b"\n\n"


def completion_final_event(created: int, model: str, text: str, reason: str | None, prompt: int,
                           completion: int) -> bytes:
    """The last streamed token, as `Completion::Final` with usage (the reason as TGI names it)."""
    return b"data:" + orjson.dumps({
        "object": "text_completion", "id": "", "created": created, "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}],
        "usage": _usage(prompt, completion),
    }) + b"\n\n"


def info_body(model_id: str, max_input_tokens: int, max_total_tokens: int, max_concurrent_requests: int) -> bytes:
    """`Info` (router/src/lib.rs), with the launcher's defaults."""
    return orjson.dumps({
        "model_id": model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": max_concurrent_requests, "max_best_of": 2, "max_stop_sequences": 4,
        "max_input_tokens": max_input_tokens, "max_total_tokens": max_total_tokens, "validation_workers": 2,
        "max_client_batch_size": 4, "router": ROUTER, "version": VERSION, "sha": None, "docker_label": None,
    })


def models_body(model_id: str) -> bytes:
    """`/v1/models`: TGI lists its one model, owned by itself."""
    return orjson.dumps({"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                                     "owned_by": model_id}]})


def timing_headers(characters: int, total: float, queue: float, inference: float, prompt: int,
                   generated: int) -> dict[str, str]:
    """The headers `generate_internal` sets (seconds in, TGI's units out)."""
    per_token = inference / max(1, generated)
    return {
        "x-compute-type": COMPUTE_TYPE, "x-compute-time": rust_float(total),
        "x-compute-characters": str(characters), "x-total-time": str(int(total * 1000)),
        "x-validation-time": "0", "x-queue-time": str(int(queue * 1000)),
        "x-inference-time": str(int(inference * 1000)), "x-time-per-token": str(int(per_token * 1000)),
        "x-prompt-tokens": str(prompt), "x-generated-tokens": str(generated),
    }

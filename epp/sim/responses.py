"""Response bodies and SSE events in the exact key order and shape of vLLM 0.32's captures.

Streaming events are built from a prefix and suffix fixed per request, so a token costs one
small string join rather than a dict and a JSON dump.
"""

from __future__ import annotations

import orjson

SYSTEM_FINGERPRINT = "vllm-0.32.0-sim"
DONE = b"data: [DONE]\n\n"


def _usage(prompt: int, completion: int) -> dict[str, object]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int) -> bytes:
    return orjson.dumps({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                     "prompt_token_ids": None, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {**_usage(prompt_tokens, completion_tokens), "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    })


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str,
              prompt_tokens: int, completion_tokens: int) -> bytes:
    return orjson.dumps({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                     "token_ids": None, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {**_usage(prompt_tokens, completion_tokens), "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    })


class CompletionEvents:
    """SSE events of one streamed /v1/completions response."""

    __slots__ = ("_head",)

    def __init__(self, rid: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{_js(rid)},"object":"text_completion","created":{created},'
                      f'"model":{_js(model)},"choices":')

    def token(self, text: str, finish_reason: str | None) -> str:
        fr = "null" if finish_reason is None else _js(finish_reason)
        return (f'{self._head}[{{"index":0,"text":{_js(text)},"logprobs":null,"finish_reason":{fr},'
                f'"stop_reason":null,"prompt_token_ids":null,"token_ids":null}}]}}\n\n')

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        u = orjson.dumps(_usage(prompt_tokens, completion_tokens)).decode()
        return f'{self._head}[],"usage":{u},"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n'


class ChatEvents:
    """SSE events of one streamed /v1/chat/completions response."""

    __slots__ = ("_head",)

    def __init__(self, rid: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{_js(rid)},"object":"chat.completion.chunk","created":{created},'
                      f'"model":{_js(model)},"choices":')

    def role(self) -> str:
        return (f'{self._head}[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":null,'
                f'"prompt_text":null}}\n\n')

    def token(self, text: str, finish_reason: str | None) -> str:
        if finish_reason is None:
            tail = '"finish_reason":null,"token_ids":null'
        else:
            tail = f'"finish_reason":{_js(finish_reason)},"stop_reason":null,"token_ids":null'
        return (f'{self._head}[{{"index":0,"delta":{{"content":{_js(text)}}},"logprobs":null,'
                f'{tail}}}]}}\n\n')

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        u = orjson.dumps(_usage(prompt_tokens, completion_tokens)).decode()
        return f'{self._head}[],"usage":{u},"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n'


def models_body(model: str, adapters: tuple[str, ...], max_model_len: int, created: int,
                perm_ids: list[str]) -> bytes:
    def perm(i: int) -> dict[str, object]:
        return {"id": f"modelperm-{perm_ids[i]}", "object": "model_permission", "created": created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}

    data = [{"id": model, "object": "model", "created": created, "owned_by": "vllm",
             "root": model, "parent": None, "max_model_len": max_model_len, "permission": [perm(0)]}]
    for i, name in enumerate(adapters, start=1):
        data.append({"id": name, "object": "model", "created": created, "owned_by": "vllm",
                     "root": f"/adapters/{name}", "parent": model, "max_model_len": None,
                     "permission": [perm(i)]})
    return orjson.dumps({"object": "list", "data": data})


def _js(s: str) -> str:
    return orjson.dumps(s).decode()

"""Which requests are sliced, and the body of each slice.

A slice continues the text so far: for a completion, `prompt` + everything generated; for a chat
completion, the messages plus the partial assistant message, rendered by the server as a message
to continue (vLLM's `continue_final_message: true, add_generation_prompt: false`). Its
`max_tokens` is what is left of the client's limit, at most S.

Only requests whose meaning survives the cut are sliced; every other request passes through as
it came, with the reason logged:
- one choice (`n`, `best_of` absent or 1), a text prompt (token-id prompts would need the
  generated ids), no `echo`, `suffix`, log-probabilities or `min_tokens`;
- no stop strings or stop token ids (one could straddle two slices) and no repetition penalties
  (a continuation would count the generated text as prompt);
- no tools, functions, response formats or guided decoding (a grammar cannot resume mid-output);
- a limit above S, or none (the client then gets what an unsliced request would: up to the
  server's context limit or the end of the sequence).
"""

from __future__ import annotations

from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PATHS = (COMPLETIONS, CHAT)

_UNSUPPORTED = ("suffix", "stop_token_ids", "tools", "tool_choice", "functions", "function_call",
                "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "prompt_logprobs", "logit_bias", "bad_words", "allowed_token_ids")
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # neutral: 0, 0, 1


def limit(body: dict[str, Any], path: str) -> int | None:
    """The client's output-token limit (None: no limit given)."""
    value = body.get("max_completion_tokens") if path == CHAT else None
    if value is None:
        value = body.get("max_tokens")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def unsliceable(body: Any, path: str, slice_tokens: int) -> str | None:
    """Why this request passes through unsliced, or None if it is sliced."""
    if path not in PATHS:
        return "not a completion"
    if not isinstance(body, dict):
        return "body is not a JSON object"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "more than one choice"
    if path == COMPLETIONS:
        if not isinstance(body.get("prompt"), str):
            return "prompt is not one text"
        if body.get("echo") or body.get("logprobs") not in (None, False, 0):
            return "echo or logprobs"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return "messages are not a list of objects"
        if body.get("logprobs") or body.get("top_logprobs"):
            return "logprobs"
        if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
            return "already continues a message"
    if body.get("stop") not in (None, "", []):
        return "stop strings"
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, [], {}):
            return key
    for key in _PENALTIES:
        neutral = 1 if key == "repetition_penalty" else 0
        if body.get(key) not in (None, neutral):
            return key
    if body.get("min_tokens") not in (None, 0):
        return "min_tokens"
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous usage stats"
    if options is not None and not isinstance(options, dict):
        return "stream_options is not an object"
    n = limit(body, path)
    if n is not None and n <= slice_tokens:
        return "short enough"
    return None


def slice_body(body: dict[str, Any], path: str, generated: str, max_tokens: int, index: int) -> dict[str, Any]:
    """The request for slice `index` (0: the first), after `generated` text."""
    out = dict(body)
    if path == CHAT:
        out.pop("max_completion_tokens", None)
    out["max_tokens"] = max_tokens
    if out.get("stream"):
        options = dict(out.get("stream_options") or {})
        options["include_usage"] = True  # every slice's token count: what is left of the limit
        out["stream_options"] = options
    if index == 0 or not generated:
        return out
    if path == COMPLETIONS:
        out["prompt"] = body["prompt"] + generated
    else:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": generated}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    return out

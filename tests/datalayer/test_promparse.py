from __future__ import annotations

import contextlib
import math
import os
import random

import pytest

from epp.datalayer.promparse import MetricsParseError, PageMemory, WantedNames, parse_wanted

from .helpers import fixture_body

VLLM = ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info", "vllm:lora_requests_info"]

EXPECTED = {  # fixture -> (running, waiting, kv usage), from the fixtures' README
    "idle": (0.0, 0.0, 0.0),
    "busy": (4.0, 8.0, 14 / 63),
    "after": (0.0, 0.0, 0.0),
    "priority": (4.0, 6.0, 8 / 63),
}


def test_fixtures_give_the_documented_values(vllm_fixture: tuple[str, bytes]) -> None:
    name, body = vllm_fixture
    got = parse_wanted(body, VLLM)
    assert "vllm:lora_requests_info" not in got  # LoRA is off in these runs
    running, waiting, kv = EXPECTED[name]
    for metric, value in (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting)):
        (sample,) = got[metric]
        assert sample.value == value
        assert sample.labels == {"engine": "0", "model_name": "tiny"}
        assert sample.timestamp is None
    assert got["vllm:kv_cache_usage_perc"][0].value == pytest.approx(kv)
    (info,) = got["vllm:cache_config_info"]
    assert info.labels["block_size"] == "128"
    assert info.labels["num_gpu_blocks"] == "64"
    assert info.labels["kv_cache_max_concurrency"] == "8.0"
    assert info.labels["kv_cache_dtype_skip_layers"] == "[]"
    assert len(info.labels) == 37


def test_a_name_that_prefixes_another_does_not_take_its_lines() -> None:
    body = fixture_body("busy")
    got = parse_wanted(body, ["vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason"])
    assert [s.value for s in got["vllm:num_requests_waiting"]] == [8.0]
    by_reason = got["vllm:num_requests_waiting_by_reason"]
    assert [(s.labels["reason"], s.value) for s in by_reason] == [("capacity", 8.0), ("deferred", 0.0)]


def test_counter_and_histogram_names_are_exact() -> None:
    body = fixture_body("busy")
    got = parse_wanted(body, ["vllm:prompt_tokens_total", "vllm:iteration_tokens_total"])
    assert len(got["vllm:prompt_tokens_total"]) == 1
    # a histogram declared as ..._total has only _bucket/_sum/_count series, no bare samples
    assert "vllm:iteration_tokens_total" not in got


def test_missing_names_are_absent_and_comments_never_match() -> None:
    body = b"# HELP foo a foo\n# TYPE foo gauge\n# foo 3\nbar 1\n"
    assert parse_wanted(body, ["foo", "nope"]) == {}


def test_first_line_and_last_line_without_newline() -> None:
    got = parse_wanted(b"foo 1\nbar{a=\"x\"} 2", ["foo", "bar"])
    assert got["foo"][0].value == 1.0
    assert got["bar"][0].value == 2.0
    assert got["bar"][0].labels == {"a": "x"}


def test_escaped_label_values_and_commas_inside_quotes() -> None:
    body = (b'm{path="C:\\\\dir",quote="say \\"hi\\"",nl="a\\nb",list="a,b, c",other="x\\ty"} 1\n'
            b"m{} 2\nm{a=\"1\",} 3\n")
    first, empty, trailing = parse_wanted(body, ["m"])["m"]
    assert first.labels == {"path": "C:\\dir", "quote": 'say "hi"', "nl": "a\nb", "list": "a,b, c",
                            "other": "x\\ty"}
    assert empty.labels == {} and empty.value == 2.0
    assert trailing.labels == {"a": "1"} and trailing.value == 3.0


def test_whitespace_tabs_and_crlf_are_tolerated() -> None:
    body = b'm { a = "1" , b="2" }\t5 \r\nn\t7\r\n'
    got = parse_wanted(body, ["m", "n"])
    assert got["m"][0].labels == {"a": "1", "b": "2"}
    assert got["m"][0].value == 5.0
    assert got["n"][0].value == 7.0


def test_special_values_and_timestamps() -> None:
    body = b"a NaN\nb +Inf 1700000000000\nc -Inf\nd 1.5e-3 17 # {trace_id=\"x\"} 1\ne 2 # exemplar\n"
    got = parse_wanted(body, ["a", "b", "c", "d", "e"])
    assert math.isnan(got["a"][0].value)
    assert got["b"][0].value == math.inf and got["b"][0].timestamp == 1700000000000
    assert got["c"][0].value == -math.inf
    assert got["d"][0].value == 0.0015 and got["d"][0].timestamp == 17
    assert got["e"][0].value == 2 and got["e"][0].timestamp is None


@pytest.mark.parametrize(
    "line, why",
    [
        (b'm{a="1"', "label set"),  # truncated mid label set
        (b'm{a="1', "label set"),  # truncated inside a quoted value
        (b'm{a="1"}', "missing value"),  # truncated before the value
        (b"m{a=1} 3", "label set"),  # unquoted value
        (b'm{a="1" b="2"} 3', "label set"),  # missing comma
        (b"m seven", "not a number"),
        (b"m 1 2 3", "after the timestamp"),
        (b"m 1 soon", "timestamp is not a number"),
        (b'm{a="\xff"} 1', "UTF-8"),
    ],
)
def test_bad_wanted_lines_raise_with_line_number(line: bytes, why: str) -> None:
    body = b"# TYPE m gauge\nother 1\n" + line
    with pytest.raises(MetricsParseError) as err:
        parse_wanted(body, ["m"])
    assert why in str(err.value)
    assert str(err.value).startswith("m at line 3:")


def test_garbage_in_unwanted_lines_is_ignored() -> None:
    body = b"junk{{{ !!\nother{a=\"unterminated 1\nm 4\n\xff\xfe nonsense\n"
    assert parse_wanted(body, ["m"])["m"][0].value == 4.0


def test_binary_body_is_rejected() -> None:
    with pytest.raises(MetricsParseError, match="NUL byte"):
        parse_wanted(os.urandom(4096) + b"\0", ["m"])


def test_random_bytes_never_crash() -> None:
    rnd = random.Random(7)
    for _ in range(200):
        junk = bytes(rnd.randrange(1, 256) for _ in range(rnd.randrange(0, 400)))
        body = junk.replace(b"\0", b"") + b"\nm" + junk[:20] + b"\nm 1\n"
        with contextlib.suppress(MetricsParseError):
            parse_wanted(body, ["m"])


def test_huge_body_with_wanted_names_at_the_end() -> None:
    filler = b"# HELP filler x\n" + b"filler_metric{a=\"b\"} 1\n" * 800_000  # ~19 MB
    body = filler + b'm{x="y"} 42\n'
    assert parse_wanted(body, ["m", "absent"])["m"][0].value == 42.0


def test_pathological_label_set_is_linear() -> None:
    line = b"m{" + b'a="b",' * 200_000  # never closed
    with pytest.raises(MetricsParseError):
        parse_wanted(line, ["m"])


def test_wanted_names_are_reusable_and_deduplicated() -> None:
    wanted = WantedNames(["b", "a", "b"])
    assert wanted.names == ("a", "b")
    body = b"a 1\nb 2\n"
    assert parse_wanted(body, wanted) == parse_wanted(body, wanted)


def test_page_memory_parses_only_what_changed_and_gives_the_same_result() -> None:
    body = fixture_body("busy")
    memory = PageMemory()
    first = parse_wanted(body, VLLM, memory)
    assert not memory.unchanged  # nothing to compare with yet
    second = parse_wanted(body, VLLM, memory)
    assert memory.unchanged
    assert second["vllm:cache_config_info"][0] is first["vllm:cache_config_info"][0]
    assert second == first == parse_wanted(body, VLLM)
    # a value moves (and shifts every later offset): only that family is parsed again, and the
    # unchanged label set of its line is reused
    moved = body.replace(b'vllm:num_requests_running{engine="0",model_name="tiny"} 4.0',
                         b'vllm:num_requests_running{engine="0",model_name="tiny"} 1234.0')
    assert moved != body
    third = parse_wanted(moved, VLLM, memory)
    assert not memory.unchanged
    assert third == parse_wanted(moved, VLLM)
    assert third["vllm:num_requests_running"][0].value == 1234.0
    assert third["vllm:num_requests_running"][0].labels is first["vllm:num_requests_running"][0].labels
    assert third["vllm:cache_config_info"][0] is first["vllm:cache_config_info"][0]


def test_page_memory_finds_families_that_moved_far_or_went_away() -> None:
    body = b"a 1\nb{x=\"1\"} 2\nb{x=\"2\"} 3\nc 4\n"
    memory = PageMemory()
    assert parse_wanted(body, ["b", "c"], memory) == parse_wanted(body, ["b", "c"])
    shifted = b"# " + b"x" * 5000 + b"\n" + body  # far beyond the search window
    assert parse_wanted(shifted, ["b", "c"], memory) == parse_wanted(shifted, ["b", "c"])
    shorter = b"b{x=\"2\"} 3\nc 4\n"  # the family now starts at offset 0, one line fewer
    assert parse_wanted(shorter, ["b", "c"], memory) == parse_wanted(shorter, ["b", "c"])
    gone = b"c 4\n"
    assert parse_wanted(gone, ["b", "c"], memory) == {"c": parse_wanted(gone, ["c"])["c"]}
    assert not memory.unchanged


def test_page_memory_looks_for_an_absent_family_again_after_some_polls() -> None:
    memory = PageMemory(recheck_absent=3)
    assert parse_wanted(b"a 1\n", ["a", "b"], memory).keys() == {"a"}
    with_b = b"a 1\nb 2\n"
    seen = [("b" in parse_wanted(with_b, ["a", "b"], memory)) for _ in range(4)]
    assert seen == [False, False, False, True]  # skipped three polls, then found
    assert not memory.unchanged
    assert "b" in parse_wanted(with_b, ["a", "b"], memory) and memory.unchanged


def test_page_memory_still_reports_errors_in_changed_lines() -> None:
    memory = PageMemory()
    parse_wanted(b"m{a=\"1\"} 1\n", ["m"], memory)
    with pytest.raises(MetricsParseError, match="value is not a number"):
        parse_wanted(b"m{a=\"1\"} nope\n", ["m"], memory)
    with pytest.raises(MetricsParseError, match="malformed"):
        parse_wanted(b"m{a=\"1\"\n", ["m"], memory)


def _fresh_and_remembered(pages: list[bytes], wanted: list[str]) -> list[bool]:
    """Parse each page with one memory and without: the same samples every time (or the same
    error). Returns `same_labels` after each page."""
    memory = PageMemory(recheck_absent=0)
    flags = []
    for page in pages:
        try:
            fresh = parse_wanted(page, wanted)
        except MetricsParseError as exc:
            with pytest.raises(MetricsParseError) as caught:
                parse_wanted(page, wanted, memory)
            assert str(caught.value) == str(exc)
            flags.append(False)
            continue
        assert parse_wanted(page, wanted, memory) == fresh, page
        flags.append(memory.same_labels)
    return flags


def test_a_one_line_family_is_followed_through_every_change_of_shape() -> None:
    one = b'a 1\nm_total{x="1"} 9\nm{x="1"} 2\nz 3\n'
    pages = [
        one,
        one.replace(b"} 2", b"} 5"),  # the value moves: only it is read
        one.replace(b"} 2", b"} 5 1700000000000"),  # a timestamp appears (still one line, same labels)
        one.replace(b'm{x="1"} 2\n', b'm{x="1"} 5\nm{x="2"} 6\n'),  # a second line after it
        one.replace(b"} 2", b"} 7"),
        one.replace(b'm{x="1"} 2\n', b'm{x="0"} 1\nm{x="1"} 5\n'),  # a second line before it
        one.replace(b"} 2", b"} 8"),
        one.replace(b'm{x="1"} 2', b'm{x="9"} 2'),  # its labels change
        one.replace(b'm{x="1"} 2', b'm{x="9",y="1"} 4'),
        b'm{x="9",y="1"} 4\nz 3\n',  # now the first line of the page (no newline before it)
        b"# " + b"p" * 5000 + b'\nm{x="9",y="1"} 4\nz 3\n',  # far beyond the search window
        b'# HELP m{x="9",y="1"} 4\nz 3\n',  # gone (a comment that looks like it does not count)
        one,  # back
        one.replace(b"} 2", b"} nope"),  # a garbage value: the same error with or without memory
        one.replace(b"} 2", b"} 2 3 4"),
        one.replace(b"} 2", b"} +Inf"),
        one.replace(b'm{x="1"} 2', b'm{x="1"} 2\x00'),  # binary
        one.replace(b"} 2", b"} 6"),
    ]
    flags = _fresh_and_remembered(pages, ["m", "z"])
    assert flags[1] and flags[2] and flags[15] and flags[17]
    assert not any(flags[i] for i in (0, 3, 4, 5, 7, 8, 11, 12))


def test_the_memory_agrees_with_a_fresh_parse_on_pages_that_change_at_random() -> None:
    """A vLLM page changed the ways a pod can change it, one change per poll: values (also in
    families before the wanted ones, which shifts them), new series, families that go away and
    come back, labels, junk, whole families moved. The memory never changes the result."""
    rng = random.Random(7)
    base = fixture_body("busy")
    lines = base.split(b"\n")
    wanted = VLLM + ["vllm:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_sum"]
    pages = [base]
    for _ in range(400):
        page = list(pages[-1].split(b"\n")) if rng.random() < 0.8 else list(lines)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(page))
            line = page[i]
            kind = rng.random()
            if line.startswith(b"#") or not line:
                continue
            if kind < 0.5:  # a value moves
                head = line.rsplit(b" ", 1)[0]
                page[i] = head + b" " + repr(rng.random() * rng.choice((1, 10, 1000))).encode()
            elif kind < 0.6:  # another series of the family
                page.insert(i + rng.randint(0, 1), line.replace(b'engine="0"', b'engine="1"'))
            elif kind < 0.7:  # a line goes away
                del page[i]
            elif kind < 0.8:  # its labels change
                page[i] = line.replace(b'model_name="tiny"', b'model_name="tiny-' + str(rng.randrange(3)).encode() + b'"')
            elif kind < 0.85:  # garbage
                page[i] = line.rsplit(b" ", 1)[0] + b" " + rng.choice((b"x", b"1 2 3", b"", b"NaN", b"{"))
            elif kind < 0.95:  # the family moves elsewhere (with a long comment before it)
                del page[i]
                page.insert(rng.randrange(len(page)), line)
                page.insert(rng.randrange(len(page)), b"# " + b"q" * rng.randrange(3000))
            else:  # a prefix family next to it
                page.insert(i, line.replace(b"{", b"_extra{", 1))
        pages.append(b"\n".join(page))
    flags = _fresh_and_remembered(pages, wanted)
    assert sum(flags) > 50  # the shortcut was taken, and agreed

"""The page template: a page matches only when it is the template's page with other numbers."""

from __future__ import annotations

import pytest

from epp.datalayer.page_template import PageTemplate
from epp.datalayer.promparse import PageMemory, parse_wanted

PAGE = (b'# TYPE q gauge\nq{m="a"} 1.0\n# TYPE r gauge\nr{m="a"} 2.0 1700000000000\n'
        b'info{block_size="16",x="y"} 1.0\nh_sum{m="a"} 3.5\nh_sum{m="b"} 4.5\n')
NAMES = ("q", "r", "h_sum")


def template() -> PageTemplate:
    memory = PageMemory()
    parse_wanted(PAGE, (*NAMES, "info"), memory)
    made = PageTemplate.of(PAGE, memory, NAMES)
    assert made is not None
    return made


def test_the_open_tokens_are_the_values_of_the_named_families_in_page_order() -> None:
    made = template()
    assert made.values(PAGE) == [b"1.0", b"2.0", b"3.5", b"4.5"]
    assert made.families == (("q", 0, 1), ("r", 1, 1), ("h_sum", 2, 2))
    moved = PAGE.replace(b"} 1.0\n# TYPE r", b"} 17\n# TYPE r").replace(b"3.5", b"NaN")
    assert made.values(moved) == [b"17", b"2.0", b"NaN", b"4.5"]


@pytest.mark.parametrize("page", [
    PAGE.replace(b'block_size="16"', b'block_size="32"'),  # a label-read family's line
    PAGE.replace(b"info{block_size=\"16\",x=\"y\"} 1.0", b"info{block_size=\"16\",x=\"y\"} 2.0"),  # its value
    PAGE.replace(b"2.0 1700000000000", b"2.0 1700000000001"),  # a timestamp
    PAGE.replace(b'q{m="a"}', b'q{m="b"}'),  # a label
    PAGE + b"q{m=\"c\"} 1\n",  # a line more
    PAGE[:-1],  # a byte less
    PAGE.replace(b"} 1.0\n", b"} 1.0 \0\n", 1),  # a NUL
    PAGE.replace(b"} 1.0\n", b"} 1 2 3\n", 1),  # more tokens
    PAGE.replace(b"} 1.0\n", b"} #1\n", 1),  # a comment for a value
    PAGE.replace(b"} 1.0\n", b"} \n", 1),  # no value
    PAGE.replace(b"} 1.0\n", b"} 1.0\nq{m=\"a\"} 5\n", 1),  # the line twice
], ids=["label-read line", "label-read value", "timestamp", "label", "line more", "byte less", "NUL",
        "tokens", "comment", "no value", "line twice"])
def test_any_other_change_is_not_a_match(page: bytes) -> None:
    assert template().values(page) is None


def test_a_family_absent_from_the_page_is_not_open() -> None:
    memory = PageMemory()
    parse_wanted(PAGE, ("q", "absent"), memory)
    made = PageTemplate.of(PAGE, memory, ("q", "absent"))
    assert made is not None and made.families == (("q", 0, 1),)
    assert made.values(PAGE + b"absent 1\n") is None

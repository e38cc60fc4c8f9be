from __future__ import annotations

import pytest

from epp.datalayer.spec import MetricSpec, parse_spec


@pytest.mark.parametrize(
    "text, name, labels",
    [
        ("vllm:num_requests_waiting", "vllm:num_requests_waiting", ()),
        ("  spaced  ", "spaced", ()),
        ("m{request_type=waiting}", "m", (("request_type", "waiting"),)),
        ('m{request_type="waiting"}', "m", (("request_type", "waiting"),)),
        ("m{a='x', b = \"y\" ,}", "m", (("a", "x"), ("b", "y"))),
        ('m{a="with, comma",b="q\\"uote"}', "m", (("a", "with, comma"), ("b", 'q"uote'))),
        ('{__name__="m",a="1"}', "m", (("a", "1"),)),
        ("m{__meta_x=1,a=2}", "m", (("a", "2"),)),
        ("m{}", "m", ()),
    ],
)
def test_valid_specs(text: str, name: str, labels: tuple[tuple[str, str], ...]) -> None:
    assert parse_spec(text) == MetricSpec(name, labels)


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_spec_turns_the_metric_off(text: str) -> None:
    assert parse_spec(text) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("m{a!=b}", "only `=` matchers"),
        ("m{a=~b.*}", "only `=` matchers"),
        ("m{a=}", "cannot read labels"),
        ("m{a=b", "expected `,` or `}`"),
        ("m{a=b c=d}", "expected `,` or `}`"),
        ("m x", "unexpected"),
        ("{a=b}", "metric name"),
        ("9m", "unexpected"),
    ],
)
def test_invalid_specs(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_matching_and_rendering() -> None:
    spec = parse_spec("m{a=1,b=2}")
    assert spec is not None
    assert spec.matches({"a": "1", "b": "2", "c": "3"})
    assert not spec.matches({"a": "1"})
    assert not spec.matches({"a": "1", "b": "3"})
    assert MetricSpec("m").matches({})
    assert str(spec) == 'm{a="1",b="2"}'
    assert parse_spec(str(spec)) == spec

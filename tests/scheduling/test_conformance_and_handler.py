"""Conformance plugins and the single-profile handler."""

from __future__ import annotations

import pytest

from epp.errors import EppError
from epp.scheduling.framework import SchedulerProfile
from epp.scheduling.plugins.destination_endpoint_served_verifier import DestinationEndpointServedVerifier
from epp.scheduling.plugins.header_based_testing_filter import HeaderBasedTestingFilter
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler
from epp.scheduling.scheduler import Scheduler

from .helpers import cycle, endpoint, request

A = endpoint("10.0.0.1", 3000)
A2 = endpoint("10.0.0.1", 3002)
B = endpoint("10.0.0.2", 3000)
V6 = endpoint("fd00::5", 3000)
EPS = [A, A2, B, V6]


def pick(header: str | None) -> list:  # type: ignore[type-arg]
    headers = {} if header is None else {"test-epp-endpoint-selection": header}
    return HeaderBasedTestingFilter().filter(cycle(), request(headers=headers), EPS)


def test_header_filter_order_follows_header() -> None:
    assert pick("10.0.0.2:3000, 10.0.0.1:3000") == [B, A]


def test_header_filter_ip_port_is_exact() -> None:
    assert pick("10.0.0.1:3002") == [A2]
    assert pick("10.0.0.1:9999") == []


def test_header_filter_bare_ip_and_dedupe_by_ip() -> None:
    assert pick("10.0.0.1") == [A2]  # one endpoint per IP (the reference keeps the last listed)
    assert pick("10.0.0.1:3000,10.0.0.1:3002,10.0.0.1") == [A]


def test_header_filter_ipv6() -> None:
    assert pick("[fd00::5]:3000") == [V6]
    assert pick("[fd00::5]") == [V6]
    assert pick("fd00::5") == [V6]


def test_header_filter_missing_or_empty_header_leaves_nothing() -> None:
    assert pick(None) == []
    assert pick("  ") == []
    assert pick(" , ,") == []
    assert pick("10.9.9.9") == []


def test_empty_filter_result_is_a_429() -> None:
    profile = SchedulerProfile("conformance-profile", filters=[HeaderBasedTestingFilter()], picker=MaxScorePicker())
    scheduler = Scheduler({"conformance-profile": profile}, SingleProfileHandler())
    with pytest.raises(EppError) as err:
        scheduler.schedule(request(), EPS)
    assert err.value.http_status == 429
    assert err.value.message == "failed to find target endpoint: failed to run scheduler profile 'conformance-profile'"
    result = scheduler.schedule(request(headers={"test-epp-endpoint-selection": "10.0.0.2"}), EPS)
    assert result.primary is B and result.primary_profile == "conformance-profile"


def test_served_verifier_echoes_the_served_endpoint() -> None:
    verifier = DestinationEndpointServedVerifier()
    assert verifier.response_received(request(), "10.0.0.1:3000") == {
        "x-conformance-test-served-endpoint": "10.0.0.1:3000"
    }
    assert verifier.response_received(request(), "")["x-conformance-test-served-endpoint"].startswith("fail:")

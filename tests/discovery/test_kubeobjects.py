"""The pure rules: which pods are endpoints, under which names, and which objectives are ours."""

from __future__ import annotations

import pytest

from epp.discovery.kubeobjects import (
    ACTIVE_PORTS_ANNOTATION,
    ENGINE_LABEL,
    PoolSpec,
    active_ports,
    objective_priority,
    parse_pool,
    parse_ports,
    parse_selector,
    pod_endpoints,
    pod_is_ready,
    standalone_pool_name,
)
from tests.discovery.fakeapi import inference_objective, inference_pool, pod

POOL = PoolSpec("pool", "default", (("app", "vllm"),), (8000,))
DP = PoolSpec("pool", "default", (("app", "vllm"),), (8000, 8001, 8002))


def test_parse_pool_reads_selector_ports_protocol_and_picker_ref() -> None:
    spec = parse_pool(inference_pool("p", {"app": "vllm", "tier": "a"}, (8000, 8001, 8000),
                                     app_protocol="kubernetes.io/h2c", epp="p-epp"))
    assert spec.selector == (("app", "vllm"), ("tier", "a"))
    assert spec.label_selector == "app=vllm,tier=a"
    assert spec.target_ports == (8000, 8001)  # unique, in order
    assert spec.app_protocol == "kubernetes.io/h2c"
    assert spec.endpoint_picker is not None and spec.endpoint_picker.name == "p-epp"
    assert spec.endpoint_picker.port == 9002 and spec.endpoint_picker.failure_mode == "FailOpen"


def test_parse_pool_defaults_and_errors() -> None:
    spec = parse_pool(inference_pool("p", {"app": "x"}))
    assert spec.app_protocol == "http" and spec.endpoint_picker is None
    with pytest.raises(ValueError, match="matchLabels"):
        parse_pool(inference_pool("p", {}))
    with pytest.raises(ValueError, match="targetPorts"):
        parse_pool(inference_pool("p", {"app": "x"}, ()))
    with pytest.raises(ValueError, match=r"targetPorts\[0\]"):
        parse_pool(inference_pool("p", {"app": "x"}, (70000,)))


def test_readiness_needs_ready_condition_and_no_deletion() -> None:
    assert pod_is_ready(pod("a", "127.0.0.2"))
    assert not pod_is_ready(pod("a", "127.0.0.2", ready=False))
    assert not pod_is_ready(pod("a", "127.0.0.2", deleting=True))
    no_conditions = pod("a", "127.0.0.2")
    no_conditions["status"]["conditions"] = []
    assert not pod_is_ready(no_conditions)


def test_one_port_endpoint_is_named_after_the_pod() -> None:
    [ep] = pod_endpoints(pod("vllm-0", "127.0.0.2", {"app": "vllm", ENGINE_LABEL: "sglang"}), POOL)
    assert (ep.name, ep.address, ep.namespace, ep.engine) == ("vllm-0", "127.0.0.2:8000", "default", "sglang")
    assert dict(ep.labels)["app"] == "vllm"


def test_several_ports_are_ranks() -> None:
    eps = pod_endpoints(pod("vllm-0", "127.0.0.2", {"app": "vllm"}), DP)
    assert [(e.name, e.port) for e in eps] == [("vllm-0-rank-0", 8000), ("vllm-0-rank-1", 8001),
                                               ("vllm-0-rank-2", 8002)]
    assert all(e.engine == "" for e in eps)  # unlabelled: the extractor's default engine


def test_active_ports_annotation_limits_ranks_and_keeps_their_names() -> None:
    p = pod("vllm-0", "127.0.0.2", {"app": "vllm"}, annotations={ACTIVE_PORTS_ANNOTATION: "8002, 8000,9999,x"})
    assert active_ports(p) == frozenset({8000, 8002, 9999})
    assert [e.name for e in pod_endpoints(p, DP)] == ["vllm-0-rank-0", "vllm-0-rank-2"]
    drained = pod("vllm-0", "127.0.0.2", {"app": "vllm"}, annotations={ACTIVE_PORTS_ANNOTATION: ""})
    assert pod_endpoints(drained, DP) == []
    assert active_ports(pod("x", "127.0.0.2")) is None


def test_unready_unaddressed_or_unselected_pods_have_no_endpoints() -> None:
    assert pod_endpoints(pod("a", "127.0.0.2", {"app": "vllm"}, ready=False), POOL) == []
    assert pod_endpoints(pod("a", "", {"app": "vllm"}), POOL) == []
    assert pod_endpoints(pod("a", "127.0.0.2", {"app": "other"}), POOL) == []


def test_ipv6_pod_address_is_bracketed() -> None:
    [ep] = pod_endpoints(pod("a", "fd00::2", {"app": "vllm"}), POOL)
    assert ep.address == "[fd00::2]:8000"


def test_objective_belongs_to_pool_by_pool_ref() -> None:
    assert objective_priority(inference_objective("chat", "pool", 5), "pool") == (True, 5)
    assert objective_priority(inference_objective("chat", "pool"), "pool") == (True, None)
    assert objective_priority(inference_objective("chat", "other", 5), "pool") == (False, None)
    foreign = inference_objective("chat", "pool", 1)
    foreign["spec"]["poolRef"]["group"] = "example.com"
    assert objective_priority(foreign, "pool") == (False, None)


def test_standalone_flags() -> None:
    assert parse_selector("app=vllm, tier==gpu") == (("app", "vllm"), ("tier", "gpu"))
    for bad in ("", "app", "=x", "a b=c"):
        with pytest.raises(ValueError):
            parse_selector(bad)
    assert parse_ports("8000,8001,8000") == (8000, 8001)
    for bad in ("", "0", "x", ",".join(str(8000 + i) for i in range(9))):
        with pytest.raises(ValueError):
            parse_ports(bad)
    assert standalone_pool_name("vllm-epp-7d9f8b6c5d-x2k4p") == "vllm-epp"
    assert standalone_pool_name("epp") == "epp"
    assert standalone_pool_name("") == "standalone"

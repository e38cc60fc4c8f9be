"""Least privilege, checked against behaviour: every call the EPP makes (discovery and leader
election, through their failure paths) is granted by the RBAC we ship, and every grant but `get`
is used."""

from __future__ import annotations

import re

import yaml
from kubernetes import client

from epp.discovery.leader import LeaderElector, LeaseTiming, lease_name
from tests.chart.conftest import MANIFESTS, rules
from tests.discovery.conftest import discovering, eventually
from tests.discovery.fakeapi import FakeApiServer, Request, inference_objective, inference_pool, pod

RESOURCE = re.compile(r"^/apis?/(?:(?P<group>[^/]+)/)?(?P<version>v[^/]+)/namespaces/[^/]+/(?P<resource>[^/]+)"
                      r"(?:/(?P<name>[^/]+))?$")


def permission(request: Request) -> tuple[str, str, str] | None:
    """The (apiGroup, resource, verb) an apiserver would authorize this request as."""
    match = RESOURCE.match(request.path)
    if match is None:  # API discovery (/apis/<group>/<version>) is open to every authenticated user
        return None
    group = match["group"] if request.path.startswith("/apis/") else ""
    if request.method == "GET":
        verb = "get" if match["name"] else ("watch" if request.query.get("watch") in ("true", "1") else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[request.method]
    return group or "", match["resource"], verb


async def test_every_call_is_granted_and_every_grant_is_used(fake: FakeApiServer, api: client.ApiClient) -> None:
    fake.apply(inference_pool("pool", {"app": "vllm"}))
    fake.apply(pod("vllm-0", "127.0.1.1", {"app": "vllm"}))
    fake.apply(inference_objective("chat", "pool", 1))
    timing = LeaseTiming(lease_duration=1.0, renew_deadline=0.5, retry_period=0.05)
    async with discovering(api) as (_, datastore):
        one = LeaderElector(api, "default", lease_name("default", "pool"), identity="one", timing=timing)
        two = LeaderElector(api, "default", lease_name("default", "pool"), identity="two", timing=timing)
        await one.start()
        await eventually(lambda: one.is_leader)
        await two.start()
        fake.expire_watches()  # relists too
        await eventually(lambda: fake.count("pods", watch=False) >= 2)
        await one.stop()  # release
        await eventually(lambda: two.is_leader)
        await two.stop()
        await eventually(lambda: fake.count("events", method="POST") >= 2)
    used = {p for r in list(fake.requests) if (p := permission(r))}
    granted = set().union(*(rules(d) for d in yaml.safe_load_all((MANIFESTS / "rbac.yaml").read_text())
                            if d and d["kind"] == "Role"))
    assert used <= granted, f"calls not granted: {used - granted}"
    assert {g for g in granted - used if g[2] != "get"} == set(), f"unused grants: {granted - used}"

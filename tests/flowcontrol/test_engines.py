"""Engines in one pool: vLLM's `priority` goes only to engines that have the field, and a native
API (TGI's, SGLang's) is admitted only to its engine. Built through the composition root, so the
admission resolves engines exactly as the data layer does."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from epp.api.request import parse_request
from epp.core import build_core
from epp.datastore import Datastore, EndpointSpec
from epp.errors import Code, EppError
from epp.flowcontrol.admission import default_engine_of
from epp.flowcontrol.flow_admission import FlowControlAdmission

from .helpers import HEADER, Clock

CONFIG = HEADER + """\
plugins:
- type: queue-scorer
- type: round-robin-fairness-policy
- {type: core-metrics-extractor, parameters: {engineLabelKey: example.com/engine}}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
flowControl:
  vllmPriority: {}
  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}
"""

VLLM, TGI, TGI_BY_LABEL = "10.0.0.1:8000", "10.0.0.2:8080", "10.0.0.3:8080"


def pool(*specs: EndpointSpec) -> Datastore:
    clock = Clock()
    datastore = Datastore(clock=clock)
    for spec in specs:
        ep = datastore.upsert(spec)
        ep.metrics = replace(ep.metrics, update_time=clock())  # freshly scraped, idle
    return datastore


def mixed() -> Datastore:
    return pool(EndpointSpec("vllm-0", "10.0.0.1", 8000, engine="vllm"),
                EndpointSpec("tgi-0", "10.0.0.2", 8080, engine="tgi"),
                EndpointSpec("tgi-1", "10.0.0.3", 8080, labels=(("example.com/engine", "tgi"),)))


def openai(subset: str | None = None):  # type: ignore[no-untyped-def]
    r = parse_request(orjson.dumps({"model": "m", "prompt": "hello"}), path="/v1/completions", request_id="r")
    r.subset = [subset] if subset else None
    return r


def native(body: dict[str, object], path: str = "/generate"):  # type: ignore[no-untyped-def]
    return parse_request(orjson.dumps(body), path=path, request_id="r")


@pytest.fixture
async def core():  # type: ignore[no-untyped-def]
    built = build_core(mixed(), CONFIG, tick=0.01)
    await built.admission.start()
    try:
        yield built
    finally:
        await built.admission.stop()


async def handle(core, request):  # type: ignore[no-untyped-def]
    decision, record = await core.director.handle_request(request)
    core.director.release(record)
    return decision


async def test_vllm_priority_is_written_for_vllm_pods_only(core) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(core.admission, FlowControlAdmission)
    to_vllm = await handle(core, openai(VLLM))
    assert [ep.address for ep in to_vllm.targets] == [VLLM]
    assert to_vllm.body is not None and orjson.loads(to_vllm.body)["priority"] == 0
    for address in (TGI, TGI_BY_LABEL):  # by the static field, and by the configured label key
        to_tgi = await handle(core, openai(address))
        assert [ep.address for ep in to_tgi.targets] == [address]
        assert to_tgi.body is None  # forwarded as the client sent it: no `priority`


async def test_native_apis_go_only_to_their_engine(core) -> None:  # type: ignore[no-untyped-def]
    for body, path in (({"inputs": "hi", "parameters": {"max_new_tokens": 4}}, "/generate"),
                       ({"inputs": "hi"}, "/generate_stream")):
        for _ in range(6):
            decision = await handle(core, native(body, path))
            assert decision.targets[0].address in (TGI, TGI_BY_LABEL)
            assert decision.body is None
    with pytest.raises(EppError) as e:  # SGLang's /generate, and no SGLang pod in the pool
        await handle(core, native({"text": "hi"}))
    assert e.value.code is Code.SERVICE_UNAVAILABLE and e.value.http_status == 503
    assert e.value.message == "no endpoint serves the sglang/generate API (needs engine sglang)"
    assert all(ep.inflight_requests == 0 for ep in core.datastore.endpoints())


async def test_without_flow_control_native_apis_are_narrowed_too() -> None:
    legacy = build_core(pool(EndpointSpec("vllm-0", "10.0.0.1", 8000)), None, tick=0.01)
    with pytest.raises(EppError, match="no endpoint serves the tgi/generate API"):
        await legacy.director.handle_request(native({"inputs": "hi"}))
    decision, record = await legacy.director.handle_request(openai())
    legacy.director.release(record)
    assert decision.body is None  # the legacy admission writes no fields at all


def test_the_default_resolver_matches_the_extractors_defaults() -> None:
    from epp.datalayer import CoreMetricsExtractor
    from epp.datastore import Endpoint

    extractor = CoreMetricsExtractor()
    for spec in (EndpointSpec("a", "10.0.0.1", 1), EndpointSpec("b", "10.0.0.1", 2, engine="tgi"),
                 EndpointSpec("c", "10.0.0.1", 3, engine="vllm",
                              labels=(("inference.networking.k8s.io/engine-type", "sglang"),))):
        ep = Endpoint(spec)
        assert default_engine_of(ep) == extractor.engine_of(ep)

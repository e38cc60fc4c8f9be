"""Shared fixtures: an in-process EPP on free ports with static endpoints.

`NO_SCRAPE` is the built-in default profile with metric collection off (the endpoints are fake).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from epp.config.options import Options
from epp.discovery.static import StaticDiscovery
from epp.runner import EndpointPicker

NO_SCRAPE = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 2}
dataLayer:
  sources: []
"""


@contextlib.asynccontextmanager
async def running_picker(**overrides) -> AsyncIterator[EndpointPicker]:  # type: ignore[no-untyped-def]
    values = dict(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, bind_address="127.0.0.1",
                  secure_serving=False, static_endpoints="10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000",
                  config_text=NO_SCRAPE)
    values.update(overrides)
    options = Options(**values)
    discovery = None if options.static_endpoints or options.static_endpoints_file else StaticDiscovery([])
    picker = EndpointPicker(options, discovery=discovery)
    await picker.start()
    try:
        yield picker
    finally:
        await picker.stop(grace=0)


@pytest.fixture
def picker_factory() -> Callable[..., contextlib.AbstractAsyncContextManager[EndpointPicker]]:
    return running_picker


@contextlib.asynccontextmanager
async def channel_to(picker: EndpointPicker) -> AsyncIterator[grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}")
    try:
        yield channel
    finally:
        await channel.close()

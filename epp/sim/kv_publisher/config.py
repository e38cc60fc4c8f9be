"""vLLM's `--kv-events-config`: the JSON object, validated, and resolved per simulated pod.

The keys, defaults and meaning are those of `vllm/config/kv_events.py` (0.32): unknown keys are
errors (vLLM's config forbids extra fields); `publisher` defaults to "zmq" when events are enabled
and to "null" otherwise; events flow only when `enable_kv_cache_events` is true and the publisher
is "zmq".

Endpoints follow vLLM's publisher: an endpoint containing `*` or `::`, or an `ipc://` or
`inproc://` one, is *bound*; any other (a concrete host) is *connected* to a subscriber that binds.
The replay endpoint is always bound. vLLM offsets both by the data-parallel rank (tcp: port + rank,
except port 0; inproc: a `_dp<rank>` suffix; ipc cannot be offset). Our pods are separate servers
that share one host, so pod *i* applies that offset with *i* to every endpoint it binds — the only
way N pods can bind "the same" port — but a connect endpoint is not offset: separate vLLM servers
all connect to the one address the router binds (llm-d's central mode) and the topic tells them
apart. The topic may name the pod with `{ip}`, `{port}` (its HTTP address) and `{model}`, as in
llm-d's convention `kv@{ip}:{port}@{model}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from epp.params import ConfigError, Params

__all__ = ["ConfigError", "KVEventsConfig", "PodPublisherSettings", "is_bind_endpoint", "offset_endpoint"]

FLAG = "--kv-events-config"
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(slots=True, frozen=True)
class PodPublisherSettings:
    """What one pod's publisher opens: endpoints after the per-pod offset, the expanded topic."""

    endpoint: str
    bind: bool
    replay_endpoint: str | None
    topic: str
    buffer_steps: int
    hwm: int
    max_queue_size: int


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` fields with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's value; ConfigError names the offending key."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{FLAG}: invalid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{FLAG}: must be a JSON object, got {type(raw).__name__}")
        p = Params(raw, FLAG)
        d = _DEFAULTS
        enable = p.bool("enable_kv_cache_events", False)
        publisher = p.str("publisher", "zmq" if enable else "null", choices=("null", "zmq"))
        endpoint = p.str("endpoint", d.endpoint)
        replay = p.str("replay_endpoint", "") or None
        cfg = cls(
            enable_kv_cache_events=enable,
            publisher=publisher,
            endpoint=endpoint,
            replay_endpoint=replay,
            buffer_steps=p.int("buffer_steps", d.buffer_steps, min=0),
            hwm=p.int("hwm", d.hwm, min=0),
            max_queue_size=p.int("max_queue_size", d.max_queue_size, min=1),
            topic=p.str("topic", d.topic),
        )
        p.done()
        _check_endpoint("endpoint", endpoint)
        if replay is not None:
            _check_endpoint("replay_endpoint", replay)
        return cfg

    @property
    def enabled(self) -> bool:
        """True when a publisher runs (vLLM's factory returns its null publisher otherwise)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def warnings(self) -> list[str]:
        """Settings that do nothing, said as vLLM says them."""
        if self.publisher != "null" and not self.enable_kv_cache_events:
            return ["KV cache events are disabled, but the publisher is configured: set "
                    "enable_kv_cache_events to true to publish them"]
        return []

    def for_pod(self, index: int, *, ip: str, port: int, model: str) -> PodPublisherSettings:
        """Pod `index`'s endpoints and topic (ValueError if an endpoint cannot be offset)."""
        bind = is_bind_endpoint(self.endpoint)
        endpoint = offset_endpoint(self.endpoint, index) if bind else self.endpoint
        replay = offset_endpoint(self.replay_endpoint, index) if self.replay_endpoint else None
        topic = self.topic.replace("{ip}", ip).replace("{port}", str(port)).replace("{model}", model)
        return PodPublisherSettings(endpoint=endpoint, bind=bind, replay_endpoint=replay, topic=topic,
                                    buffer_steps=self.buffer_steps, hwm=self.hwm,
                                    max_queue_size=self.max_queue_size)

    def check_pods(self, count: int) -> None:
        """Fail now, not at the n-th pod's start, if `count` pods cannot each get their endpoints."""
        for index in range(count):
            self.for_pod(index, ip="", port=0, model="")


_DEFAULTS = KVEventsConfig()


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, index: int) -> str:
    """vLLM's per-rank offset: tcp port + index (port 0 stays 0), inproc name + `_dp<index>`."""
    if index == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{index}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        if int(port) + index > 65535:
            raise ValueError(f"{endpoint}: port {port} + pod index {index} exceeds 65535")
        return f"{base}:{int(port) + index}"
    raise ValueError(f"{endpoint}: only tcp ports and inproc names can be offset per pod "
                     "(as vLLM offsets data-parallel ranks); run one pod per process for ipc")


def _check_endpoint(key: str, endpoint: str) -> None:
    if not endpoint.startswith(_SCHEMES):
        raise ConfigError(f"{FLAG}.{key}: {endpoint!r} must start with tcp://, ipc:// or inproc://")
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{FLAG}.{key}: {endpoint!r} must be tcp://HOST:PORT")
        if int(port) == 0 and not is_bind_endpoint(endpoint) and key == "endpoint":
            raise ConfigError(f"{FLAG}.{key}: {endpoint!r}: a connect endpoint needs a port")
    elif endpoint.endswith("://"):
        raise ConfigError(f"{FLAG}.{key}: {endpoint!r} has no address")

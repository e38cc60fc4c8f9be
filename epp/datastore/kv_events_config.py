"""`kvEventsConfig`: where the EPP listens for (or dials) the engines' KV events.

Parsed by `precise-prefix-cache-producer` at config load (so `epp check-config` validates it) and
read by the data layer's subscriber at start. llm-d's shape, plus what a local setup needs:

```yaml
kvEventsConfig:
  zmqEndpoint: "tcp://*:5557"   # central mode: bind one SUB; pods connect, topic kv@<ip>:<port>@<model>
  topicFilter: "kv@"
  discoverPods: false           # true (no zmqEndpoint): one SUB per endpoint at tcp://<pod ip>:<socketPort>
  podDiscoveryConfig:
    socketPort: 5557
    socketPortOffset: 0         # > 0: socket port = endpoint port + offset (several servers on one IP)
    endpoints: {"10.0.0.7:8000": "tcp://10.0.0.7:5601"}   # explicit per-endpoint sockets
  replay:                       # vLLM's ROUTER replay socket (`replay_endpoint`); off when no port
    socketPort: 0
    socketPortOffset: 0
    endpoints: {}
    timeout: 2s
  silentAfter: 60s              # warn about endpoints that never sent an event
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.params import ConfigError, Params

DEFAULT_TOPIC_FILTER = "kv@"
DEFAULT_SOCKET_PORT = 5557


@dataclass(slots=True, frozen=True)
class SocketMap:
    """How to find one endpoint's socket: a fixed port, an offset from its serving port, or an
    explicit address per endpoint."""

    port: int = 0
    offset: int = 0
    endpoints: dict[str, str] = field(default_factory=dict)

    def url(self, ip: str, serving_port: int, address: str) -> str | None:
        explicit = self.endpoints.get(address)
        if explicit:
            return explicit
        if self.offset:
            port = serving_port + self.offset
        elif self.port:
            port = self.port
        else:
            return None
        host = f"[{ip}]" if ":" in ip else ip
        return f"tcp://{host}:{port}"


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    zmq_endpoint: str = ""
    topic_filter: str = DEFAULT_TOPIC_FILTER
    discover_pods: bool = True
    sockets: SocketMap = field(default_factory=lambda: SocketMap(port=DEFAULT_SOCKET_PORT))
    replay: SocketMap = field(default_factory=SocketMap)
    replay_timeout: float = 2.0
    silent_after: float = 60.0

    @property
    def central(self) -> bool:
        return bool(self.zmq_endpoint)

    @classmethod
    def from_mapping(cls, raw: object, path: str) -> KVEventsConfig:
        params = Params(raw, path)
        endpoint = params.str("zmqEndpoint", "")
        if endpoint and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise params.error("zmqEndpoint", f"must be a ZMQ address (tcp://*:5557), got {endpoint!r}")
        discover = params.bool("discoverPods", not endpoint)
        if endpoint and discover:
            raise params.error("discoverPods", "cannot be true with zmqEndpoint (central mode binds one socket)")
        if not endpoint and not discover:
            raise params.error("zmqEndpoint", "is required when discoverPods is false")
        sockets = _socket_map(params.mapping("podDiscoveryConfig"), f"{path}.podDiscoveryConfig",
                              DEFAULT_SOCKET_PORT, ("socketPort", "socketPortOffset", "endpoints",
                                                    "podLabelSelector", "podNamespace"))
        replay_raw = params.mapping("replay")
        replay = _socket_map(replay_raw, f"{path}.replay", 0,
                             ("socketPort", "socketPortOffset", "endpoints", "timeout"))
        replay_timeout = Params(replay_raw, f"{path}.replay").duration("timeout", 2.0)
        config = cls(
            zmq_endpoint=endpoint,
            topic_filter=params.str("topicFilter", DEFAULT_TOPIC_FILTER),
            discover_pods=discover,
            sockets=sockets,
            replay=replay,
            replay_timeout=replay_timeout,
            silent_after=params.duration("silentAfter", 60.0),
        )
        params.done()
        return config


def _socket_map(raw: dict[str, object], path: str, default_port: int, allowed: tuple[str, ...]) -> SocketMap:
    params = Params(raw, path)
    for key in ("podLabelSelector", "podNamespace"):
        if params.has(key):  # llm-d watches pods itself; here discovery is the EPP's own
            raise params.error(key, "is not used: the EPP's own discovery (--pool-name / static) names the pods")
    port = params.int("socketPort", default_port, min=0, max=65535)
    offset = params.int("socketPortOffset", 0, min=-65535, max=65535)
    endpoints = params.mapping("endpoints")
    for key, value in endpoints.items():
        if not isinstance(value, str) or not value.startswith("tcp://"):
            raise ConfigError(f"{path}.endpoints.{key}: must be a tcp:// address, got {value!r}")
    params.duration("timeout", 0.0)  # read here only so done() accepts it (replay)
    for key in list(raw):
        if key not in allowed:
            raise ConfigError(f"{path}.{key}: unknown field")
    return SocketMap(port=port, offset=offset, endpoints={str(k): str(v) for k, v in endpoints.items()})

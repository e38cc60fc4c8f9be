"""An endpoint (one port of one model-server pod) and the signals we hold about it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from epp.datastore.batch_limit import BatchLimit
from epp.datastore.load import EndpointLoad
from epp.datastore.service_model import ServiceModel


def join_host_port(ip: str, port: int) -> str:
    """`ip:port`, with IPv6 bracketed, as Go's JoinHostPort writes it (the wire format)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """Inverse of `join_host_port`; raises ValueError on anything else."""
    address = address.strip()
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"invalid endpoint address {address!r}")
        port = rest[1:]
    else:
        host, sep, port = address.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"invalid endpoint address {address!r}")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid endpoint address {address!r}")
    return host, int(port)


@dataclass(slots=True, frozen=True)
class EndpointMetrics:
    """One scrape of a model server, immutable so a reader never sees half an update.

    `update_time` is on the datastore's clock (monotonic seconds); 0.0 means never scraped.
    """

    waiting_queue_size: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0  # fraction 0..1
    models: frozenset[str] = frozenset()  # model names the server reports (vLLM's `model_name` label)
    active_models: frozenset[str] = frozenset()  # LoRA adapters running
    waiting_models: frozenset[str] = frozenset()  # LoRA adapters waiting
    max_active_models: int = 0  # max_lora
    cache_block_size: int = 0  # tokens per KV block
    cache_num_blocks: int = 0  # KV blocks on the device
    # The longest sequence (prompt + output) the engine runs, 0 when it does not say: vLLM stops a
    # request's output there (it does not reject a larger max_tokens), so no request holds more KV.
    max_model_len: int = 0
    update_time: float = 0.0
    # Mean inter-token latency (seconds) over the last scrape window, from the engine's histogram
    # sum/count deltas; 0.0 when unknown (first scrape, no metric) or the pod is idle.
    inter_token_latency: float = 0.0
    # The histogram's cumulative sum and count at this scrape: the baseline for the next delta,
    # not a signal, so they are left out of comparisons.
    itl_sum: float = field(default=0.0, compare=False)
    itl_count: float = field(default=0.0, compare=False)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the pod's KV cache holds; 0 when it does not say its cache size."""
        return self.cache_num_blocks * self.cache_block_size


EMPTY_METRICS = EndpointMetrics()


@dataclass(slots=True, frozen=True)
class EndpointSpec:
    """What discovery knows about an endpoint: identity and where to scrape it."""

    name: str  # pod name, with `-rank-<i>` for the i-th target port when a pod has several
    ip: str
    port: int
    namespace: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    engine: str = ""  # "" = unlabelled: the extractor's default engine applies
    metrics_port: int = 0  # 0: scrape on `port`
    address: str = field(init=False, compare=False, repr=False)  # "ip:port", read on every pick

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", join_host_port(self.ip, self.port))


@dataclass(slots=True, eq=False)
class Endpoint:
    """A live endpoint. Discovery owns `spec`; the data layer owns `metrics`, `scrape_error` and
    `metrics_valid`; request control owns the in-flight counters and the ledger of outstanding
    work (exact, unlike the scraped signals) and teaches the service model what the pod charges.

    `metrics_valid` is False while the server's last readable scrape held a value out of bounds
    (a fraction above 1, a NaN or negative count, ...; `scrape_error` says which): `metrics` then
    still holds the last valid scrape, ageing, and nothing that reads the pool as a whole
    (saturation, pool statistics, the candidates of a pick) should trust it."""

    spec: EndpointSpec
    metrics: EndpointMetrics = EMPTY_METRICS
    scrape_error: str = ""
    metrics_valid: bool = True
    inflight_requests: int = 0
    inflight_tokens: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    load: EndpointLoad = field(default_factory=EndpointLoad)
    service: ServiceModel = field(default_factory=ServiceModel)
    batch_limit: BatchLimit = field(default_factory=BatchLimit)
    # When the page behind `metrics` was asked for (the datastore's clock; the pod wrote it then or
    # a little later): the ledger's snapshot is of that moment (`EndpointLoad.mark_scrape`).
    metrics_asked: float = 0.0
    # `spec.address`, the key every pick reads per candidate many times over (a property cost a
    # call each time). Fixed for the endpoint's life: the datastore keys endpoints by it, and a
    # new spec for the same key keeps it.
    address: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.labels = dict(self.spec.labels)
        self.address = self.spec.address

    def update_metrics(self, metrics: EndpointMetrics, asked: float = 0.0) -> None:
        """A new valid scrape (the data layer's one write), its page asked for at `asked` (0:
        when it was read, `update_time`): the ledger notes what it held then."""
        # What the EPP sent in the last two steps may wait for the next one (the scraped gauges
        # are the last step's end, and it admits what arrived during it).
        step = self.load.step_seconds
        since = metrics.update_time - 2.0 * step if step > 0.0 else self.metrics.update_time
        self.metrics = metrics
        self.metrics_valid = True
        self.metrics_asked = asked or metrics.update_time
        self.load.mark_scrape(self.metrics_asked)
        self.batch_limit.observe(metrics.running_requests, metrics.waiting_queue_size, metrics.kv_cache_usage,
                                 self.load.prefill_backlog, self.service.prior.max_batched_tokens,
                                 self.load.sent_since(since))

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return f"Endpoint({self.spec.address})"


def with_valid_metrics(endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """The endpoints whose metrics are valid, for a pick: a pod reporting garbage is not scored
    on it (a NaN or negative queue would win every min-max). All of them when none is valid
    (fail open: a pool whose exporters all misbehave still serves, as with stale metrics)."""
    valid = [ep for ep in endpoints if ep.metrics_valid]
    return valid if valid else list(endpoints)


def longest_sequence(endpoints: Iterable[Endpoint]) -> int:
    """The most tokens (prompt + output) a request can hold on any of these pods: their largest
    `max_model_len`, or 0 when one of them does not say (then nothing is known to bound it).

    A client's `max_tokens` counts up to 2^20 and, until the model's output lengths are learned,
    is the output expected; vLLM stops the output at `max_model_len` instead, so one huge limit
    would otherwise be a footprint larger than a pod's cache — every other prefix gone from the
    approximate index's view of it, and its KV forecast swollen."""
    longest = 0
    for ep in endpoints:
        length = ep.metrics.max_model_len
        if length <= 0:
            return 0
        if length > longest:
            longest = length
    return longest


def output_room(longest: int, prompt: int) -> int:
    """The output tokens a `longest`-token sequence (`longest_sequence`) leaves after a `prompt`
    of that many tokens, at least 1 — for `ModelStats.expected_output(max_tokens, room)`; 0 (no
    bound) when `longest` is unknown."""
    return max(1, longest - prompt) if longest > 0 else 0

"""Batch slots: how many of each flow's requests flow control has running on each endpoint.

A vLLM engine runs at most `max_num_seqs` requests at once (its *slots*); a request beyond that
waits in the engine's FIFO queue until one finishes, however soon a fair order would have served
it. Flow control sees every request it dispatches (with the endpoint the scheduler chose) and
every completion, so it knows exactly how many of each flow's requests occupy each endpoint,
without a scrape. Three decisions read this ledger:

- **Fair share** (`slotFairness` on a band): while another flow of the band waits, a flow that
  holds at least `slots / active flows of the band` of an endpoint's requests gets no new
  dispatch *there* (it may still go to an endpoint where it holds less). With no other flow
  waiting nothing is held back: one flow alone still uses every slot (work conservation).
- **Newcomer reserve** (`newcomerReserve: R` on a band): the last R slots of each endpoint are
  kept for flows with nothing on it. While another flow is about (waiting in the band, or
  running on that endpoint), a flow that already has requests there stops at `slots - R` (the
  reserve's throughput cost, paid only by a flood larger than that); a flow alone uses every
  slot (work conservation: a newcomer then waits for the first one to free). A flow
  with nothing there may take a slot even while the band's dispatch gate is closed for the
  endpoint (a queue at its threshold), at most R such requests outstanding per endpoint, so
  the gate's bound on the engine queue grows by R at most. With vLLM's priority (below) such a
  request enters at the front of the engine's queue. The reserve is at most 1/32 of the
  endpoint's slots (`reserve`): what it holds back is capacity a lone flood cannot use, cheap
  on vLLM's default 256 slots (2 of them: < 1%) and ruinous on a pod of 8 (2 of them: a
  quarter of a saturated pool's throughput), which gets none; fair share still protects
  newcomers there.
- **vLLM priority depth**: the n-th request of a flow already on an endpoint gets
  `priority = base + n` (n from 0), so the engine's waiting queue interleaves flows as round
  robin does and, under KV pressure, pre-empts the deepest flow's newest-numbered request first.

**Slots per endpoint.** vLLM does not export `max_num_seqs` (its only config gauge,
`vllm:cache_config_info`, carries CacheConfig labels: blocks, block size, dtype, no scheduler
settings), so it is configured (`flowControl.maxNumSeqs`, vLLM's default 256) and corrected per
endpoint from its scrapes (`epp.datastore.batch_limit`): running requests prove at least that
many slots, so a configured value that is too low corrects itself; requests seen waiting for a
slot (KV room, no prompt filling the step's budget) at the most the pod ever ran show the real
limit, so one that is too high does too, once the pod has been full. The value is capped at
`MAX_SLOTS` whatever a pod reports.

Cost: O(1) per dispatch, completion and check; memory bounded by the requests in flight (an
entry is dropped when its count returns to zero) plus one integer per endpoint seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.datastore import Endpoint

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's --max-num-seqs default
MAX_SLOTS = 65_536  # a learned slot count never exceeds this (vLLM's max_num_seqs is in the hundreds)
RESERVE_FRACTION = 32  # a newcomer reserve holds back at most 1/32 of an endpoint's slots

FlowKey = tuple[int, str]  # (band priority, fairness id): a flow


@dataclass(slots=True)
class EndpointSlots:
    """Flow control's requests on one endpoint, dispatched and not yet completed."""

    inflight: int = 0
    reserved: int = 0  # of those, sent into the newcomer reserve past a closed gate
    by_flow: dict[FlowKey, int] = field(default_factory=dict)


class SlotLedger:
    """Per endpoint, each flow's requests in flight there (see the module docstring)."""

    __slots__ = ("max_num_seqs", "_eps")

    def __init__(self, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        self.max_num_seqs = max_num_seqs
        self._eps: dict[Endpoint, EndpointSlots] = {}

    def of(self, endpoint: Endpoint) -> EndpointSlots:
        slots = self._eps.get(endpoint)
        if slots is None:
            slots = self._eps[endpoint] = EndpointSlots()
        return slots

    def slots(self, endpoint: Endpoint) -> int:
        """Running slots of the endpoint: the configured count, corrected by its scrapes."""
        return min(MAX_SLOTS, endpoint.batch_limit.limit(self.max_num_seqs))

    def reserve(self, endpoint: Endpoint, configured: int) -> int:
        """The endpoint's newcomer reserve: the band's, at most 1/32 of its slots."""
        return min(configured, self.slots(endpoint) // RESERVE_FRACTION)

    def has_free_slot(self, endpoint: Endpoint) -> bool:
        """Whether our requests there number fewer than its slots."""
        entry = self._eps.get(endpoint)
        return entry is None or entry.inflight < self.slots(endpoint)

    def held(self, endpoint: Endpoint, flow: FlowKey) -> int:
        entry = self._eps.get(endpoint)
        return entry.by_flow.get(flow, 0) if entry is not None else 0

    def add(self, endpoint: Endpoint, flow: FlowKey, *, reserved: bool = False) -> int:
        """Count a dispatch; returns how many of the flow's requests were there before it."""
        entry = self.of(endpoint)
        depth = entry.by_flow.get(flow, 0)
        entry.by_flow[flow] = depth + 1
        entry.inflight += 1
        if reserved:
            entry.reserved += 1
        return depth

    def remove(self, endpoint: Endpoint, flow: FlowKey, *, reserved: bool = False) -> None:
        """A request counted by `add` ended."""
        entry = self._eps.get(endpoint)
        if entry is None:
            return
        left = entry.by_flow.get(flow, 0) - 1
        if left > 0:
            entry.by_flow[flow] = left
        else:
            entry.by_flow.pop(flow, None)
        entry.inflight = max(0, entry.inflight - 1)
        if reserved:
            entry.reserved = max(0, entry.reserved - 1)

    def prune(self, live: Sequence[Endpoint]) -> None:
        """Forget endpoints that left the pool and hold nothing (called when the table outgrows it)."""
        if len(self._eps) > 2 * len(live) + 8:
            keep = set(live)
            self._eps = {ep: s for ep, s in self._eps.items() if ep in keep or s.inflight}

    def __len__(self) -> int:
        """Requests in flight across endpoints (for tests and invariants)."""
        return sum(s.inflight for s in self._eps.values())

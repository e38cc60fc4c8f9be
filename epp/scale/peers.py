"""One view of the pool across writers: fold the others' sums into this process's endpoints.

Each process keeps its own exact accounting — the director's in-flight counts and the ledger
(`EndpointLoad`) of the requests *it* picked — and publishes it to its rows of the shared table
whenever it changes (a pick, a first byte, an end). Before each pick it adds what the other
writers published to its own endpoints' fields, as a delta on what it added last time:

    field = own + folded        (own: this process's exact accounting; folded: the others', as read)

so every reader of an `Endpoint` (scorers, gates, saturation detectors, metrics, the admin API)
sees the pool-wide sums without knowing other processes exist, and this process's own part stays
exact (`field - folded`) to publish. The ledger's sums are designed to add up across writers
(`epp.datastore.load`); its pick and work rates decay alike everywhere, so they add at a common
time. The others' queued prefill is their own timeline's remainder when they published; each
writer re-publishes at least every `tick` while it has prefill queued, so it does not go stale.

The service model is shared by its fitted values: each writer publishes the per-pod scales it fit
from its own observations, and a reader uses the observation-weighted mean of every writer's fit
(its own included) — the estimate all the observations together give, without sharing the
regression's private sums.

What is not shared: per-model (LoRA) counts of the ledger, the ledger's FIFO timeline (a pick only
queues behind this process's own), request-level plugin state.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from epp.datastore import Datastore, Endpoint
from epp.datastore.load import RATE_WINDOW
from epp.scale import table as t
from epp.scale.table import SharedTable

log = logging.getLogger("epp.scale")

_MEMORY = 200.0  # observations a service model remembers (its forgetting 0.995 per observation)
_INT_FIELDS = (t.INFLIGHT, t.TOKENS, t.BACKLOG, t.DECODING, t.CONTEXT, t.FOOTPRINT, t.REQUESTS, t.DECODE_OUTPUT,
               t.DECODE_ENDING)


@dataclass(slots=True, eq=False)
class _Tracked:
    endpoint: Endpoint
    slot: int
    folded: list[float] = field(default_factory=lambda: [0.0] * t.F)  # others' values added, as of `folded_at`
    folded_at: float = 0.0
    versions: dict[int, int] = field(default_factory=dict)  # member -> row version last folded
    scrape_time: float = -1.0  # the `update_time` whose ledger snapshot got the others' queue
    own_fit: tuple[float, float] = (1.0, 1.0)
    own_observations: int = 0
    peer_fits: list[tuple[float, float, float]] = field(default_factory=list)  # (step, prefill, observations)
    blended_observations: int = -1  # own observations at the last blend


class SharedLoad:
    """This process's link to the table: `refresh` before a pick, `changed` after its own
    accounting of an endpoint moved (the director's hooks), `publish_all` on a timer."""

    def __init__(self, table: SharedTable, member: int, datastore: Datastore, *, readers: range | None = None) -> None:
        self.table = table
        self.member = member
        self.datastore = datastore
        self.clock = datastore.clock
        self.others = [m for m in (readers if readers is not None else range(table.members)) if m != member]
        self._tracked: dict[str, _Tracked] = {}
        self._sequences: dict[int, tuple[int, int]] = {}
        self.full = False  # the table ran out of slots once (logged)

    def start(self) -> None:
        self.datastore.subscribe(on_add=self._added, on_remove=self._removed)

    def stop(self) -> None:
        self.datastore.unsubscribe(on_add=self._added, on_remove=self._removed)
        for address in list(self._tracked):
            self._drop(address)

    # -- endpoints come and go --

    def _added(self, endpoint: Endpoint) -> None:
        try:
            slot = self.table.claim(self.member, endpoint.address)
        except ValueError as exc:
            if not self.full:
                log.error("endpoint %s is not shared with the other workers: %s", endpoint.address, exc)
                self.full = True
            return
        self._tracked[endpoint.address] = _Tracked(endpoint, slot)
        self._sequences.clear()  # fold the new endpoint at the next refresh

    def _removed(self, endpoint: Endpoint) -> None:
        tracked = self._tracked.get(endpoint.address)
        if tracked is not None and tracked.endpoint is endpoint:
            self._drop(endpoint.address)

    def _drop(self, address: str) -> None:
        tracked = self._tracked.pop(address)
        self.table.give_back(self.member, tracked.slot)

    # -- reading the others --

    def refresh(self) -> None:
        """Fold every other writer's latest sums into the endpoints (cheap when nothing moved)."""
        table = self.table
        sequences = {m: table.sequence(m) for m in self.others}  # before reading: a later write moves it again
        moved = [m for m, seq in sequences.items() if self._sequences.get(m) != seq]
        now = self.clock()
        for tracked in self._tracked.values():
            if moved and any(table.version(m, tracked.slot) != tracked.versions.get(m) for m in moved):
                self._fold(tracked, now)
            elif tracked.peer_fits and tracked.endpoint.service.observations != tracked.blended_observations:
                self._blend(tracked)  # this process learned: re-weigh its own fit against the others'
            metrics_time = tracked.endpoint.metrics.update_time
            if metrics_time != tracked.scrape_time:
                # A scrape landed: its ledger snapshot counts this process's queue only
                # (`mark_scrape` takes len(pending)); the others' requests are in it too.
                tracked.scrape_time = metrics_time
                tracked.endpoint.load.pending_at_scrape += int(tracked.folded[t.PENDING])
        self._sequences = sequences

    def _fold(self, tracked: _Tracked, now: float) -> None:
        table, slot = self.table, tracked.slot
        peers = [0.0] * t.F
        fits: list[tuple[float, float, float]] = []
        history = -1.0  # the longest history behind the others' rates (-1: they have none)
        for m in self.others:
            row = table.read(m, slot)
            tracked.versions[m] = table.version(m, slot)
            decay = math.exp(-max(0.0, now - row[t.RATES_AT]) / RATE_WINDOW) if row[t.RATES_AT] > 0 else 0.0
            for i in range(t.PICK_RATE):  # the plain sums
                peers[i] += row[i]
            peers[t.PICK_RATE] += row[t.PICK_RATE] * decay  # rates, as of now
            peers[t.WORK_RATE] += row[t.WORK_RATE] * decay
            peers[t.PREFILL_RATE] += row[t.PREFILL_RATE] * decay
            peers[t.KV_RATE] += row[t.KV_RATE] * decay
            if row[t.PICK_RATE] > 0.0:
                history = max(history, row[t.RATES_AGE] + max(0.0, now - row[t.RATES_AT]))
            if row[t.OBSERVATIONS] > 0:
                fits.append((row[t.STEP_SCALE], row[t.PREFILL_SCALE], row[t.OBSERVATIONS]))
        tracked.peer_fits = fits
        folded = tracked.folded
        ep = tracked.endpoint
        load = ep.load
        delta = [peers[i] - folded[i] for i in range(t.PICK_RATE)]
        ep.inflight_requests += round(delta[t.INFLIGHT])
        ep.inflight_tokens += round(delta[t.TOKENS])
        load.prefill_backlog += round(delta[t.BACKLOG])
        load.prefill_pairs += delta[t.PAIRS]
        load.decoding += round(delta[t.DECODING])
        load.context_tokens += round(delta[t.CONTEXT])
        load.footprint_tokens += round(delta[t.FOOTPRINT])
        load.requests += round(delta[t.REQUESTS])
        load.decode_output += round(delta[t.DECODE_OUTPUT])
        load.decode_ending += round(delta[t.DECODE_ENDING])
        load.peer_pending = round(peers[t.PENDING])  # (their queues themselves stay theirs)
        # Rates: bring own and folded parts to `now`, then swap the folded part for the new one.
        old = math.exp(-max(0.0, now - tracked.folded_at) / RATE_WINDOW) if tracked.folded_at else 0.0
        pick, work, prefill, kv = load.decayed_rates(now)
        if history >= 0.0:  # the sum has history since the oldest of its parts began
            since = now - history
            load.rates_since = since if load.rates_since < 0.0 else min(load.rates_since, since)
        load.pick_rate = max(0.0, pick - folded[t.PICK_RATE] * old + peers[t.PICK_RATE])
        load.work_rate = max(0.0, work - folded[t.WORK_RATE] * old + peers[t.WORK_RATE])
        load.prefill_rate = max(0.0, prefill - folded[t.PREFILL_RATE] * old + peers[t.PREFILL_RATE])
        load.kv_rate = max(0.0, kv - folded[t.KV_RATE] * old + peers[t.KV_RATE])
        load.rates_at = now
        for i in _INT_FIELDS:
            peers[i] = folded[i] + round(delta[i])
        tracked.folded = peers
        tracked.folded_at = now
        self._blend(tracked)

    @staticmethod
    def _blend(tracked: _Tracked) -> None:
        service = tracked.endpoint.service
        if service.observations != tracked.own_observations:  # learned since its fit was recorded
            tracked.own_fit = (service.step_scale, service.prefill_scale)
            tracked.own_observations = service.observations
        tracked.blended_observations = service.observations
        fits = tracked.peer_fits
        if not fits:
            return
        weight = min(float(tracked.own_observations), _MEMORY)
        step = weight * tracked.own_fit[0]
        prefill = weight * tracked.own_fit[1]
        for fit_step, fit_prefill, observations in fits:
            w = min(observations, _MEMORY)
            weight += w
            step += w * fit_step
            prefill += w * fit_prefill
        service.step_scale = step / weight
        service.prefill_scale = prefill / weight

    # -- publishing this process's own part --

    def changed(self, endpoint: Endpoint) -> None:
        tracked = self._tracked.get(endpoint.address)
        if tracked is not None and tracked.endpoint is endpoint:
            self._publish(tracked, self.clock())

    def publish_all(self) -> None:
        """Re-publish every endpoint with queued prefill (its remainder shrinks with time)."""
        now = self.clock()
        for tracked in self._tracked.values():
            load = tracked.endpoint.load
            if load.pending:
                load.settle(now)
                self._publish(tracked, now)

    def _publish(self, tracked: _Tracked, now: float) -> None:
        ep = tracked.endpoint
        load, service = ep.load, ep.service
        f = tracked.folded
        if service.observations != tracked.own_observations:
            tracked.own_fit = (service.step_scale, service.prefill_scale)
            tracked.own_observations = service.observations
        old = math.exp(-max(0.0, now - tracked.folded_at) / RATE_WINDOW) if tracked.folded_at else 0.0
        pick, work, prefill, kv = load.decayed_rates(now)
        self.table.write(self.member, tracked.slot, (
            ep.inflight_requests - f[t.INFLIGHT],
            ep.inflight_tokens - f[t.TOKENS],
            round(load.backlog_at(now) - f[t.BACKLOG]),
            load.prefill_pairs - f[t.PAIRS],
            load.decoding - f[t.DECODING],
            load.context_tokens - f[t.CONTEXT],
            load.footprint_tokens - f[t.FOOTPRINT],
            load.requests - f[t.REQUESTS],
            len(load.pending),
            load.decode_output - f[t.DECODE_OUTPUT],
            load.decode_ending - f[t.DECODE_ENDING],
            max(0.0, pick - f[t.PICK_RATE] * old),
            max(0.0, work - f[t.WORK_RATE] * old),
            max(0.0, prefill - f[t.PREFILL_RATE] * old),
            max(0.0, kv - f[t.KV_RATE] * old),
            now,
            tracked.own_fit[0], tracked.own_fit[1], tracked.own_observations,
            now - load.rates_since if load.rates_since >= 0.0 else 0.0,
        ))

    def own(self, address: str) -> tuple[float, ...] | None:
        """This process's own published row for an endpoint (tests, the admin API)."""
        tracked = self._tracked.get(address)
        return self.table.read(self.member, tracked.slot) if tracked is not None else None

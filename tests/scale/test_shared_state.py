"""Two request-path processes' worth of state over one real shared-memory table, in one test
process: each core has its own datastore and director, as each worker has; only the mapped files
are common. The picks interleave, as two workers' do."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Iterator

import pytest

from epp.api.request import Api, InferenceRequest
from epp.api.response import Usage
from epp.core import Core, build_core
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.datastore.load import coverage
from epp.scale import table as t
from epp.scale.member import Member, PodLayout, PodState
from epp.scale.prefix import PrefixRecord, decode, encode
from epp.scale.ring import Ring, RingReader
from epp.shm import Segment
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer

PODS = 4
_ids = itertools.count()


def request(prompt: str, *, stream: bool = False) -> InferenceRequest:
    return InferenceRequest(request_id=f"r{next(_ids)}", api=Api.COMPLETIONS, model="m", target_model="m",
                            body={"model": "m", "prompt": prompt}, prompt=prompt.encode(), max_tokens=16,
                            stream=stream)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pick(core: Core, prompt: str = "q" * 8000) -> object:
    """One streamed request scheduled by `core` (its record, still in flight)."""
    return asyncio.run(core.director.handle_request(request(prompt, stream=True)))[1]


@pytest.fixture
def layout() -> Iterator[PodLayout]:
    layout, segment = PodLayout.create(2, capacity=64, ring_bytes=1 << 16)
    yield layout
    segment.close()


def worker(layout: PodLayout, member: int, clock: Clock, config: str | None = None) -> tuple[Core, Member]:
    """A worker's state: its own datastore and core, its own mapping of the pod's segment."""
    store = Datastore(clock=clock)
    core = build_core(store, config, tick=0.05, seed=member)
    link = Member(PodState(layout), member, core)
    link.install()
    for i in range(PODS):
        ep = store.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000))
        ep.metrics = EndpointMetrics(update_time=clock.now - 0.01, cache_block_size=16, cache_num_blocks=4096)
    store.synced = True
    return core, link


def test_a_burst_split_over_two_workers_spreads_as_one_worker_would(layout: PodLayout) -> None:
    clock = Clock()
    workers = [worker(layout, m, clock) for m in range(2)]

    async def burst() -> tuple[Counter[str], list]:
        counts: Counter[str] = Counter()
        records = []
        for i in range(64):
            core, _ = workers[i % 2 if i < 32 else (i // 4) % 2]  # alternating, then in runs
            decision, record = await core.director.handle_request(request(f"question {i}: " + "x" * 300))
            counts[decision.targets[0].address] += 1
            records.append((core, record))
        return counts, records

    counts, records = asyncio.run(burst())
    assert sorted(counts.values()) == [16, 16, 16, 16], counts
    workers[0][1].refresh(), workers[1][1].refresh()
    for core, _ in workers:  # each sees the pool-wide in-flight counts
        core_view = {ep.address: ep.inflight_requests for ep in core.datastore.endpoints()}
        assert core_view == dict(counts)
    for core, record in records:
        core.director.release(record, Usage(prompt_tokens=80, completion_tokens=16))
    for core, link in workers:
        link.refresh()
        assert [ep.inflight_requests for ep in core.datastore.endpoints()] == [0] * PODS
        assert [ep.load.requests for ep in core.datastore.endpoints()] == [0] * PODS
        assert [ep.load.decoding for ep in core.datastore.endpoints()] == [0] * PODS


def test_a_dead_workers_counts_leave_the_others_view(layout: PodLayout) -> None:
    clock = Clock()
    (core_a, link_a), (core_b, link_b) = worker(layout, 0, clock), worker(layout, 1, clock)

    async def picks() -> None:
        for i in range(6):
            await core_b.director.handle_request(request(f"q{i}" + "y" * 200))

    asyncio.run(picks())
    link_a.refresh()
    assert sum(ep.inflight_requests for ep in core_a.datastore.endpoints()) == 6
    assert sum(ep.load.requests for ep in core_a.datastore.endpoints()) == 6
    assert sum(ep.load.prefill_backlog for ep in core_a.datastore.endpoints()) > 0
    PodState(layout).table.clear_member(1)  # what the supervisor does when worker 1 dies
    link_a.refresh()
    assert sum(ep.inflight_requests for ep in core_a.datastore.endpoints()) == 0
    assert sum(ep.load.requests for ep in core_a.datastore.endpoints()) == 0
    assert sum(ep.load.prefill_backlog for ep in core_a.datastore.endpoints()) == 0


def test_prefix_picks_reach_the_other_worker(layout: PodLayout) -> None:
    clock = Clock()
    (core_a, link_a), (core_b, link_b) = worker(layout, 0, clock), worker(layout, 1, clock)
    system = "You are a meticulous assistant for the ACME support desk. " * 40

    async def one(core: Core, i: int) -> str:
        decision, record = await core.director.handle_request(request(system + f"question {i}"))
        core.director.release(record)
        return decision.targets[0].address

    first = asyncio.run(one(core_a, 0))
    picks = [asyncio.run(one(core_b if i % 2 else core_a, i)) for i in range(1, 9)]
    assert set(picks) == {first}, picks  # worker B follows the prefix worker A cached
    link_a.refresh(), link_b.refresh()
    producer = next(p for p in core_b.config.plugins.values() if isinstance(p, ApproxPrefixCacheProducer))
    assert producer.index.entries == next(
        p for p in core_a.config.plugins.values() if isinstance(p, ApproxPrefixCacheProducer)).index.entries


def test_service_model_fits_are_shared_by_observation_weight(layout: PodLayout) -> None:
    clock = Clock()
    (core_a, link_a), (core_b, link_b) = worker(layout, 0, clock), worker(layout, 1, clock)
    ep_a = core_a.datastore.endpoints()[0]
    ep_b = core_b.datastore.endpoints()[0]
    for _ in range(50):  # worker B sees the pod take twice the prior's time per step
        ep_b.service.observe(0.01, 0.0, 0.02)
    link_b.changed(ep_b)
    link_a.refresh()
    assert 1.7 < ep_b.service.step_scale < 2.05
    assert ep_a.service.step_scale == pytest.approx(ep_b.service.step_scale)  # A has no observations
    for _ in range(50):  # A sees it at the prior's speed: the blend sits between, by weight
        ep_a.service.observe(0.01, 0.0, 0.01)
    link_a.changed(ep_a)
    link_a.refresh()
    assert 1.2 < ep_a.service.step_scale < 1.8


def test_ledger_sums_add_up_and_own_part_stays_exact(layout: PodLayout) -> None:
    clock = Clock()
    (core_a, link_a), (core_b, link_b) = worker(layout, 0, clock), worker(layout, 1, clock)


    rec_a = pick(core_a, "p" * 4000)
    rec_b = pick(core_b, "p" * 4000)
    link_a.refresh()
    link_b.refresh()
    for core in (core_a, core_b):
        assert sum(ep.load.requests for ep in core.datastore.endpoints()) == 2
    own_a = link_a.load.own(rec_a.endpoint.address)
    assert own_a is not None and own_a[t.REQUESTS] == 1 and own_a[t.PENDING] == 1
    # A's request still waits for its first token on its pod, as B's worker sees it (a prompt
    # B sends there joins its step); B's own queue stays B's alone.
    on_a = next(ep for ep in core_b.datastore.endpoints() if ep.address == rec_a.endpoint.address)
    assert on_a.load.peer_pending == 1 and on_a.load.prefilling_at(clock.now) == len(on_a.load.pending) + 1
    clock.now += 0.5
    core_a.director.first_byte(rec_a)  # A's request is past prefill: B sees one decoding
    link_b.refresh()
    assert sum(ep.load.decoding for ep in core_b.datastore.endpoints()) >= 1
    ending_a = sum(ep.load.decode_ending for ep in core_a.datastore.endpoints())
    assert ending_a > 0 and sum(ep.load.decode_ending for ep in core_b.datastore.endpoints()) == ending_a
    assert on_a.load.peer_pending == 0
    core_a.director.release(rec_a)
    core_b.director.release(rec_b)
    for link, core in ((link_a, core_a), (link_b, core_b)):
        link.refresh()
        loads = [ep.load for ep in core.datastore.endpoints()]
        assert ([(x.requests, x.decoding, x.prefill_backlog, x.footprint_tokens, x.decode_ending) for x in loads]
                == [(0, 0, 0, 0, 0)] * PODS)


def test_the_work_rates_of_each_workers_picks_add_up(layout: PodLayout) -> None:
    """The predictor's utilisations (all work, and the prefill part) and KV forecasts are each
    worker's picks summed: a pod two workers keep busy is as busy to each as to one worker
    sending it all."""
    clock = Clock()
    (core_a, link_a), (core_b, link_b) = worker(layout, 0, clock), worker(layout, 1, clock)


    records = [pick(core) for core in (core_a, core_b, core_a, core_b)]
    for link in (link_a, link_b):
        link.refresh()
    for core in (core_a, core_b):
        loads = [ep.load for ep in core.datastore.endpoints()]
        work = sum(x.utilization_at(clock.now) for x in loads)
        prefill = sum(x.prefill_utilization_at(clock.now) for x in loads)
        assert 0.0 < prefill < work
    seen = [[round(ep.load.prefill_utilization_at(clock.now), 9) for ep in core.datastore.endpoints()]
            for core in (core_a, core_b)]
    assert seen[0] == seen[1]
    forecasts = [[round(ep.load.kv_forecast_at(clock.now), 3) for ep in core.datastore.endpoints()]
                 for core in (core_a, core_b)]
    assert forecasts[0] == forecasts[1] and sum(forecasts[0]) > 0.0
    for core, record in zip((core_a, core_b, core_a, core_b), records):
        core.director.release(record)


def test_a_worker_that_never_picked_a_pod_reads_its_rates_as_the_picking_one_does(layout: PodLayout) -> None:
    """The rates are corrected for the history they cover (`load.coverage`); a worker
    that only folds the others' rows starts that history when it first sees them, so a warming
    pool looks as busy to it as to the worker sending the traffic — not 4× idler."""
    clock = Clock()
    (core_a, link_a), (core_b, link_b) = worker(layout, 0, clock), worker(layout, 1, clock)


    records = [pick(core_a) for _ in range(4)]
    for link in (link_a, link_b):
        link.refresh()
    rates = [[(round(ep.load.rate_at(clock.now), 9), round(ep.load.utilization_at(clock.now), 9))
              for ep in core.datastore.endpoints()] for core in (core_a, core_b)]
    assert rates[0] == rates[1]
    assert sum(r for r, _ in rates[1]) == pytest.approx(4 * 0.1 / coverage(clock.now, clock.now))
    for record in records:
        core_a.director.release(record)


def test_a_worker_started_later_reads_the_others_rates_with_their_history(layout: PodLayout) -> None:
    """A worker restarted while another has routed for long must not read the other's settled
    averages as if they had just begun (several times too high): each row says how much history
    its rates have."""
    clock = Clock()
    core_a, link_a = worker(layout, 0, clock)


    records = [pick(core_a) for _ in range(4)]
    clock.now += 30.0
    records.append(pick(core_a))
    core_b, link_b = worker(layout, 1, clock)
    for link in (link_a, link_b):
        link.refresh()
    rates = [[round(ep.load.rate_at(clock.now), 9) for ep in core.datastore.endpoints()] for core in (core_a, core_b)]
    assert rates[0] == rates[1]
    assert {ep.load.rates_since for ep in core_b.datastore.endpoints() if ep.load.pick_rate} == {100.0}
    for record in records:
        core_a.director.release(record)


def test_ring_records_survive_wraps_and_a_lapped_reader_resynchronises() -> None:
    segment = Segment.create(Ring.footprint(4096), prefix="epp-test")
    ring = Ring(segment.buf, 4096)
    reader = RingReader(ring)
    records = [PrefixRecord(1, "approx", f"10.0.0.{i % 4}:8000", list(range(i, i + 20)), 500, 3) for i in range(100)]
    seen = []
    for record in records:
        ring.append(encode(record))
        seen += [decode(p) for p in reader.read()]
    assert seen == records
    late = RingReader(ring, from_start=False)
    for record in records * 3:  # far more than the ring holds before `late` reads
        ring.append(encode(record))
    assert list(late.read()) == [] and late.lost == 1
    ring.append(encode(records[0]))
    assert [decode(p) for p in late.read()] == [records[0]]
    ring.release()
    segment.close()


def test_a_malformed_prefix_record_is_skipped_not_raised(layout: PodLayout) -> None:
    clock = Clock()
    (core_a, link_a), (core_b, link_b) = worker(layout, 0, clock), worker(layout, 1, clock)
    link_b.rings[1].append(b"\x01garbage")  # as a replica of another version might publish
    link_b.rings[1].append(encode(PrefixRecord(1, "approx-prefix-cache-producer", "10.0.0.1:8000", [1, 2, 3], 100)))
    link_a.refresh()  # before a pick: must not raise
    assert link_a.prefix is not None and link_a.prefix.malformed == 1 and link_a.prefix.applied == 1

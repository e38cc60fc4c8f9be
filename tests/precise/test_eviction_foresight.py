"""Eviction foresight: the index credits a full pod only with what survives the allocations already
sent its way, judged against the simulator's vLLM block pool (events published at step end, as
vLLM's `update_from_output` does)."""

from __future__ import annotations

from array import array

from epp.datalayer.kv_events import BlockRemoved as _Removed
from epp.datalayer.kv_events import BlockStored as _Stored
from epp.datastore.kv_block_index import MAX_RECENCY_WALK, KVBlockIndex, chain_seed, router_keys
from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.kv_cache import prepare_block_hashes
from epp.sim.request import Request

POD = "10.0.0.1:8000"
BLOCK = 16
CAPACITY_BLOCKS = 48


def document(first: int, blocks: int) -> list[int]:
    """A prompt of `blocks` full blocks and one token more (the engine caches full blocks only)."""
    return list(range(first, first + blocks * BLOCK + 1))


class Pod:
    """A simulated vLLM engine and the EPP's view of it: the index hears each step's events after
    the step, and the EPP's own sends and completions, as the producer reports them."""

    def __init__(self, foresight: bool = True) -> None:
        self.engine = Engine(EngineConfig(block_size=BLOCK, num_gpu_blocks=CAPACITY_BLOCKS, max_num_seqs=8,
                                          max_model_len=512, max_num_batched_tokens=512,
                                          enable_kv_cache_events=True))
        self.index = KVBlockIndex(BLOCK)
        self.foresight = foresight
        self.now = 0.0
        self.sent: dict[str, list[int]] = {}
        self.index.apply(POD, [], 0.0)  # the pod publishes (an empty batch)

    def keys(self, ids: list[int]) -> list[int]:
        return router_keys(ids, BLOCK, chain_seed())

    def send(self, rid: str, ids: list[int], max_tokens: int = 2) -> None:
        self.engine.add_request(Request(request_id=rid, prompt_len=len(ids), block_hashes=[], max_tokens=max_tokens,
                                        output_len=max_tokens, arrival_time=self.now,
                                        prompt_token_ids=array("i", ids)))
        self.sent[rid] = self.keys(ids)
        if self.foresight:
            self.index.dispatched(POD, self.sent[rid], self.now)

    def step(self) -> None:
        out = self.engine.schedule(self.now)
        assert out is not None
        result = self.engine.update(out)
        self.now = out.end_time
        self.index.apply(POD, self.engine.take_kv_events(), self.now)
        for req in result.finished:
            if self.foresight:
                self.index.released(POD, self.sent[req.request_id])

    def run(self) -> None:
        while self.engine.has_unfinished():
            self.step()

    def credited(self, ids: list[int]) -> int:
        """Blocks of `ids` the index credits the pod with for a request sent now."""
        keys = self.keys(ids)
        n = self.index.match(keys, self.now).matched.get(POD, 0)
        if not self.foresight:
            return n
        return self.index.foresee(POD, keys, n, CAPACITY_BLOCKS * BLOCK, len(self.engine.running))

    def cached(self, ids: list[int]) -> int:
        """Blocks of `ids` the engine really holds."""
        probe = Request(request_id="probe", prompt_len=len(ids), block_hashes=[], max_tokens=1, output_len=1,
                        arrival_time=0.0, prompt_token_ids=array("i", ids))
        prepare_block_hashes(probe, BLOCK)
        return self.engine.kv.cached_prefix_blocks(probe)


def steady_pod(foresight: bool) -> tuple[Pod, list[list[int]]]:
    """Eight 10-block documents through a 48-block pod (it has evicted), two of them used again."""
    pod = Pod(foresight)
    docs = [document(10_000 * (i + 1), 10) for i in range(8)]
    for i, doc in enumerate(docs):
        pod.send(f"doc{i}", doc)
        pod.run()
    for i in (4, 6):
        pod.send(f"again{i}", docs[i])
        pod.run()
    return pod, docs


def test_a_full_pod_is_credited_only_with_what_the_allocations_sent_before_leave() -> None:
    for foresight in (False, True):
        pod, docs = steady_pod(foresight)
        held = [pod.cached(d) for d in docs]
        assert held == [0, 0, 0, 6, 10, 10, 10, 10]
        pod.send("new", document(90_000, 16))  # sent, not yet scheduled: no event says anything yet
        credited = [pod.credited(d) for d in docs]
        pod.step()  # the step that admits it evicts the oldest blocks; its events arrive after
        truth = [pod.cached(d) for d in docs]
        assert truth == [0, 0, 0, 0, 10, 0, 10, 10]  # documents 3 and 5 went; 4 and 6 were used since
        if foresight:
            assert credited == truth
            assert pod.index.stats.foreseen_blocks == 16
        else:
            assert credited == held  # the events alone still show what the step evicted
        assert [pod.credited(d) for d in docs] == truth  # once the events arrive, both agree


def test_the_eviction_order_is_when_requests_ended_not_when_they_were_sent() -> None:
    pod, docs = steady_pod(True)
    # Document 3 is sent first but generates longer: document 5's blocks are freed first.
    pod.send("long", docs[3], max_tokens=40)
    pod.send("short", docs[5], max_tokens=2)
    pod.run()
    for i in (7, 4, 6):
        pod.send(f"later{i}", docs[i])
        pod.run()
    pod.send("new", document(90_000, 8))
    credited = [pod.credited(d) for d in docs]
    pod.step()
    truth = [pod.cached(d) for d in docs]
    assert truth[5] == 0 and truth[3] > 0  # sent second, freed first, evicted first
    assert credited == truth


def test_a_pod_with_room_keeps_its_credit() -> None:
    pod = Pod(True)
    docs = [document(10_000 * (i + 1), 10) for i in range(2)]
    for i, doc in enumerate(docs):
        pod.send(f"doc{i}", doc)
        pod.run()
    pod.send("new", document(90_000, 16))
    assert [pod.credited(d) for d in docs] == [10, 10]
    assert pod.index.stats.foreseen_blocks == 0
    pod.step()
    assert [pod.cached(d) for d in docs] == [10, 10]


def test_expected_blocks_are_forgotten_after_the_ttl() -> None:
    pod, docs = steady_pod(True)
    keys = pod.keys(document(90_000, 16))
    pod.index.dispatched(POD, keys, pod.now)  # sent, but the engine never stores them (a failed request)
    assert pod.credited(docs[5]) == 0
    pod.now += pod.index.speculative_ttl + 0.01
    assert pod.credited(docs[5]) == 10


def test_unknown_capacity_or_an_endpoint_without_events_is_left_alone() -> None:
    pod, docs = steady_pod(True)
    pod.send("new", document(90_000, 16))
    keys = pod.keys(docs[5])
    assert pod.index.foresee(POD, keys, 10, 0, 0) == 10  # no cache_config_info scraped yet
    assert pod.index.foresee("10.0.0.9:8000", keys, 10, CAPACITY_BLOCKS * BLOCK, 0) == 10


def test_a_pod_publishing_tiny_blocks_cannot_make_every_request_walk_them_all() -> None:
    index = KVBlockIndex(64)
    ids = list(range(20_000))
    hashes = list(range(1, len(ids) + 1))  # one-token engine blocks
    index.apply(POD, [_Stored(hashes, None, ids, 1)], 0.0)
    index.apply(POD, [_Removed([999_999])], 0.0)  # it has evicted: the order is kept
    ep = index._endpoints[POD]
    before = ep.clock
    index.dispatched(POD, router_keys(ids, 64, chain_seed()), 1.0)
    assert ep.clock - before == MAX_RECENCY_WALK


def test_a_malformed_event_does_not_change_the_engine_block_size_the_foresight_reads() -> None:
    pod, _ = steady_pod(True)
    pod.index.apply(POD, [_Stored([1, 2], None, [1, 2, 3], 7)], pod.now)  # 3 tokens for 2 blocks of 7
    assert pod.index._endpoints[POD].engine_block_size == BLOCK
    assert pod.index.stats.skipped_blocks["malformed"] == 2

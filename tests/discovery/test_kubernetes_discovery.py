"""KubernetesDiscovery against the fake apiserver: the datastore follows the cluster."""

from __future__ import annotations

import pytest
from kubernetes import client

from epp.datastore import Datastore
from epp.discovery.informer import WatchTuning
from epp.discovery.kubeobjects import ACTIVE_PORTS_ANNOTATION, PoolSpec
from tests.discovery.conftest import addresses, discovering, eventually, names
from tests.discovery.fakeapi import FakeApiServer, inference_objective, inference_pool, pod

APP = {"app": "vllm"}


def seed(fake: FakeApiServer, pods: int = 2, ports: tuple[int, ...] = (8000,)) -> None:
    fake.apply(inference_pool("pool", APP, ports))
    for i in range(pods):
        fake.apply(pod(f"vllm-{i}", f"127.0.1.{i + 1}", APP))


async def test_initial_sync_lists_ready_selected_pods(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake)
    fake.apply(pod("unready", "127.0.1.9", APP, ready=False))
    fake.apply(pod("other", "127.0.1.8", {"app": "other"}))
    fake.apply(pod("elsewhere", "127.0.1.7", APP, namespace="other-ns"))
    async with discovering(api) as (discovery, ds):
        assert ds.synced
        assert addresses(ds) == {"127.0.1.1:8000", "127.0.1.2:8000"}
        assert (ds.pool.name, ds.pool.namespace, ds.pool.target_ports) == ("pool", "default", (8000,))
        assert discovery.pool is not None and discovery.pool.selector == (("app", "vllm"),)
    # the pod list was filtered by the apiserver, the pool by name
    assert any(r.query.get("labelSelector") == "app=vllm" for r in fake.requests if r.path.endswith("/pods"))
    assert any(r.query.get("fieldSelector") == "metadata.name=pool" for r in fake.requests
               if r.path.endswith("/inferencepools"))


async def test_pod_lifecycle_added_ready_unready_deleted(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    async with discovering(api) as (_, ds):
        fake.apply(pod("vllm-new", "127.0.1.5", APP, ready=False))
        fake.apply(pod("vllm-0", "127.0.1.1", APP, ready=False))  # a marker event after the unready add
        await eventually(lambda: not addresses(ds), what="vllm-0 unready")
        fake.apply(pod("vllm-new", "127.0.1.5", APP))
        await eventually(lambda: addresses(ds) == {"127.0.1.5:8000"}, what="vllm-new ready")
        fake.apply(pod("vllm-new", "127.0.1.5", APP, deleting=True))
        await eventually(lambda: not addresses(ds), what="terminating pod leaves")
        fake.apply(pod("vllm-0", "127.0.1.1", APP))
        await eventually(lambda: addresses(ds) == {"127.0.1.1:8000"}, what="vllm-0 ready again")
        fake.delete("pods", "vllm-0")
        await eventually(lambda: not addresses(ds), what="vllm-0 deleted")
        assert ds.synced  # an empty pool is still a synced pool


async def test_labels_changing_moves_pod_in_and_out(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    async with discovering(api) as (_, ds):
        fake.apply(pod("vllm-0", "127.0.1.1", {"app": "retired"}))
        await eventually(lambda: not addresses(ds), what="relabelled pod leaves")
        fake.apply(pod("vllm-0", "127.0.1.1", {"app": "vllm", "extra": "x"}))
        await eventually(lambda: addresses(ds) == {"127.0.1.1:8000"}, what="relabelled pod returns")
        assert ds.get("127.0.1.1:8000").labels["extra"] == "x"  # type: ignore[union-attr]


async def test_flapping_pod_ends_in_its_final_state(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=2)
    async with discovering(api) as (_, ds):
        for i in range(25):
            fake.apply(pod("vllm-1", "127.0.1.2", APP, ready=i % 2 == 1))
        # a marker on another pod of the same watch: once seen, every flap before it was applied
        fake.apply(pod("vllm-0", "127.0.1.1", {**APP, "marker": "1"}))
        await eventually(lambda: ds.get("127.0.1.1:8000").labels.get("marker") == "1")  # type: ignore[union-attr]
        assert addresses(ds) == {"127.0.1.1:8000"}  # the last flap left it unready
        fake.apply(pod("vllm-1", "127.0.1.2", APP))
        await eventually(lambda: addresses(ds) == {"127.0.1.1:8000", "127.0.1.2:8000"}, what="settles ready")


async def test_endpoint_keeps_its_state_while_pod_stays_ready(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    async with discovering(api) as (_, ds):
        endpoint = ds.get("127.0.1.1:8000")
        assert endpoint is not None
        endpoint.inflight_requests = 3
        fake.apply(pod("vllm-0", "127.0.1.1", {**APP, "rev": "2"}))
        await eventually(lambda: ds.get("127.0.1.1:8000").labels.get("rev") == "2")  # type: ignore[union-attr]
        assert ds.get("127.0.1.1:8000") is endpoint and endpoint.inflight_requests == 3


async def test_watch_drop_reconnects_and_catches_up(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    async with discovering(api) as (_, ds):
        await eventually(lambda: fake.open_watches() == 3, what="pool, pod and objective watches")
        watches_before = fake.count("pods", watch=True)
        assert fake.drop_watches() == 3
        fake.apply(pod("vllm-1", "127.0.1.2", APP))  # happens while nobody watches
        await eventually(lambda: addresses(ds) == {"127.0.1.1:8000", "127.0.1.2:8000"}, what="catch up")
        assert fake.count("pods", watch=True) > watches_before
        # and the new watch is live
        fake.delete("pods", "vllm-0")
        await eventually(lambda: addresses(ds) == {"127.0.1.2:8000"}, what="live after reconnect")


@pytest.mark.parametrize("as_http", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists(fake: FakeApiServer, api: client.ApiClient, as_http: bool) -> None:
    fake.gone_as_http = as_http
    seed(fake, pods=2)
    async with discovering(api) as (_, ds):
        await eventually(lambda: fake.open_watches() == 3)
        lists_before = fake.count("pods", watch=False)
        if as_http:
            fake.compact()  # the next watch from an old version gets HTTP 410
            fake.apply(pod("vllm-9", "127.0.1.9", {"app": "unrelated"}))  # bumps versions, no pod event
            fake.drop_watches()
        else:
            fake.expire_watches()
        fake.apply(pod("vllm-2", "127.0.1.3", APP))
        fake.delete("pods", "vllm-0")
        await eventually(lambda: addresses(ds) == {"127.0.1.2:8000", "127.0.1.3:8000"}, what="relisted state")
        assert fake.count("pods", watch=False) > lists_before


async def test_periodic_resync_repairs_a_lost_event(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=2)
    tuning = WatchTuning(resync_period=1.0, backoff_initial=0.02, backoff_max=0.2, request_timeout=5.0)
    async with discovering(api, tuning=tuning) as (_, ds):
        lists_before = fake.count("pods", watch=False)
        fake.apply(pod("vllm-1", "127.0.1.2", APP, ready=False), silent=True)  # no watch hears it
        await eventually(lambda: addresses(ds) == {"127.0.1.1:8000"}, what="resync relist")
        assert fake.count("pods", watch=False) > lists_before


async def test_apiserver_errors_back_off_and_recover(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    async with discovering(api) as (_, ds):
        await eventually(lambda: fake.open_watches() == 3)
        fake.fail_next(4, lambda r: r.path.endswith("/pods"))
        fake.drop_watches()
        fake.apply(pod("vllm-1", "127.0.1.2", APP))
        await eventually(lambda: addresses(ds) == {"127.0.1.1:8000", "127.0.1.2:8000"}, what="recovery")


async def test_pool_deleted_empties_datastore_and_recreated_restores(fake: FakeApiServer,
                                                                      api: client.ApiClient) -> None:
    seed(fake, pods=2)
    async with discovering(api) as (discovery, ds):
        assert ds.synced and len(addresses(ds)) == 2
        fake.delete("inferencepools", "pool")
        await eventually(lambda: not addresses(ds) and not ds.synced, what="pool deletion")
        assert discovery.pool is None
        fake.apply(pod("vllm-2", "127.0.1.3", APP))  # changes while the pool is away
        fake.apply(inference_pool("pool", APP))
        await eventually(lambda: ds.synced and len(addresses(ds)) == 3, what="pool recreated")


async def test_missing_pool_at_start_is_not_synced_until_created(fake: FakeApiServer, api: client.ApiClient) -> None:
    fake.apply(pod("vllm-0", "127.0.1.1", APP))
    async with discovering(api) as (_, ds):
        assert not ds.synced and not addresses(ds)
        fake.apply(inference_pool("pool", APP))
        await eventually(lambda: ds.synced and addresses(ds) == {"127.0.1.1:8000"}, what="pool created")


async def test_pool_crd_missing_is_an_empty_pool(fake: FakeApiServer, api: client.ApiClient) -> None:
    fake.uninstall("inferencepools")
    fake.uninstall("inferenceobjectives")
    async with discovering(api) as (discovery, ds):
        assert not ds.synced and discovery.pool is None


async def test_target_ports_change_recomputes_endpoints(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    fake.apply(pod("vllm-1", "127.0.1.2", APP, annotations={ACTIVE_PORTS_ANNOTATION: "8001"}))
    async with discovering(api) as (_, ds):
        assert addresses(ds) == {"127.0.1.1:8000"}  # 8001 is not a target port yet
        fake.apply(inference_pool("pool", APP, (8000, 8001)))
        await eventually(lambda: len(addresses(ds)) == 3, what="two ranks")
        assert names(ds) == {"vllm-0-rank-0", "vllm-0-rank-1", "vllm-1-rank-1"}
        assert ds.pool.target_ports == (8000, 8001)
        fake.apply(inference_pool("pool", APP, (8001,)))
        await eventually(lambda: addresses(ds) == {"127.0.1.1:8001", "127.0.1.2:8001"}, what="one port again")
        assert names(ds) == {"vllm-0", "vllm-1"}


async def test_selector_change_rewatches_pods(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    fake.apply(pod("sglang-0", "127.0.2.1", {"app": "sglang"}))
    async with discovering(api) as (_, ds):
        assert addresses(ds) == {"127.0.1.1:8000"}
        fake.apply(inference_pool("pool", {"app": "sglang"}))
        await eventually(lambda: addresses(ds) == {"127.0.2.1:8000"}, what="new selector")
        fake.apply(pod("vllm-0", "127.0.1.1", APP, ready=False))  # the old selection no longer matters
        fake.apply(pod("sglang-1", "127.0.2.2", {"app": "sglang"}))
        await eventually(lambda: addresses(ds) == {"127.0.2.1:8000", "127.0.2.2:8000"})


async def test_objectives_follow_their_pool_ref(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    fake.apply(inference_objective("chat", "pool", 10))
    fake.apply(inference_objective("batch", "pool", -1))
    fake.apply(inference_objective("theirs", "other-pool", 99))
    datastore = Datastore()
    datastore.set_objective("from-file", 7)  # set by someone else: discovery leaves it alone
    async with discovering(api, datastore=datastore) as (_, ds):
        assert ds.objectives() == {"chat": 10, "batch": -1, "from-file": 7}
        ds.delete_objective("from-file")
        fake.apply(inference_objective("chat", "pool", 20))
        fake.apply(inference_objective("plain", "pool"))
        await eventually(lambda: ds.objectives() == {"chat": 20, "batch": -1, "plain": None})
        assert ds.objective_priority("plain") == 0
        fake.apply(inference_objective("batch", "other-pool", -1))  # moved away
        fake.delete("inferenceobjectives", "chat")
        await eventually(lambda: ds.objectives() == {"plain": None})
        fake.expire_watches()  # relist reconciles too
        fake.delete("inferenceobjectives", "plain")
        await eventually(lambda: ds.objectives() == {})


async def test_objectives_skipped_when_crd_not_installed(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    fake.uninstall("inferenceobjectives")
    async with discovering(api) as (_, ds):
        assert ds.synced and len(addresses(ds)) == 1
        await eventually(lambda: fake.open_watches() == 2, what="pool and pod watches only")
    assert fake.count("inferenceobjectives") == 0


async def test_standalone_selector_mode_watches_pods_only(fake: FakeApiServer, api: client.ApiClient) -> None:
    fake.uninstall("inferencepools")
    fake.uninstall("inferenceobjectives")
    for i in range(2):
        fake.apply(pod(f"vllm-{i}", f"127.0.1.{i + 1}", {"app": "vllm", "role": "decode"}))
    fake.apply(pod("prefill-0", "127.0.1.9", {"app": "vllm", "role": "prefill"}))
    spec = PoolSpec("vllm-epp", "default", (("app", "vllm"), ("role", "decode")), (8000, 8001))
    async with discovering(api, standalone=spec) as (discovery, ds):
        assert ds.synced and ds.pool.name == "vllm-epp"
        assert names(ds) == {"vllm-0-rank-0", "vllm-0-rank-1", "vllm-1-rank-0", "vllm-1-rank-1"}
        fake.apply(pod("vllm-0", "127.0.1.1", {"app": "vllm", "role": "decode"}, ready=False))
        await eventually(lambda: names(ds) == {"vllm-1-rank-0", "vllm-1-rank-1"})
    assert fake.count("inferencepools") == 0 and fake.count("inferenceobjectives") == 0
    assert any(r.query.get("labelSelector") == "app=vllm,role=decode" for r in fake.requests)


async def test_stop_ends_watches_promptly(fake: FakeApiServer, api: client.ApiClient) -> None:
    seed(fake, pods=1)
    async with discovering(api) as (discovery, _):
        await eventually(lambda: fake.open_watches() == 3)
    await eventually(lambda: fake.open_watches() == 0, what="watches closed after stop")
    assert discovery._pod_informer is None

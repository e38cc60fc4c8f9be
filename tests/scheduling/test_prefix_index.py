"""The per-endpoint LRU plus global key -> endpoints map."""

from __future__ import annotations

from epp.scheduling.plugins._prefix_index import PrefixIndex


def test_match_walks_in_order_and_stops_at_first_unknown_key() -> None:
    index = PrefixIndex()
    index.add([1, 2, 3], "a:1", 100)
    index.add([1, 2], "b:1", 100)
    assert index.match([1, 2, 3, 4]) == {"a:1": 3, "b:1": 2}
    assert index.match([9, 1, 2]) == {}
    assert index.match([]) == {}


def test_lru_eviction_drops_index_entries() -> None:
    index = PrefixIndex()
    index.add([1, 2, 3], "a:1", 3)
    index.add([1], "a:1", 3)  # refresh 1: now 2 is the oldest
    index.add([4], "a:1", 3)
    assert index.server_entries("a:1") == 3
    assert index.match([2]) == {}
    assert index.match([1]) == {"a:1": 1}
    assert index.entries == 3 and index.distinct_keys == 3


def test_eviction_on_one_endpoint_keeps_the_key_for_others() -> None:
    index = PrefixIndex()
    index.add([1], "a:1", 1)
    index.add([1], "b:1", 1)
    index.add([2], "a:1", 1)  # evicts 1 from a only
    assert index.match([1]) == {"b:1": 1}


def test_remove_server() -> None:
    index = PrefixIndex()
    index.add([1, 2], "a:1", 10)
    index.add([1], "b:1", 10)
    index.remove_server("a:1")
    assert index.match([1, 2]) == {"b:1": 1}
    assert index.entries == 1 and index.distinct_keys == 1 and index.servers() == ["b:1"]
    index.remove_server("nobody")

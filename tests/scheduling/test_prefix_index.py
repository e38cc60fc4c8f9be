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


def test_lru_eviction_drops_index_entries_tail_first() -> None:
    """A prompt's blocks are recorded tail first (vLLM frees a finished request's blocks to its
    eviction queue in reverse), so its shared head is the last to go."""
    index = PrefixIndex()
    index.add([1, 2, 3], "a:1", 3)
    index.add([4], "a:1", 3)  # evicts 3, the tail
    assert index.server_entries("a:1") == 3
    assert index.match([3]) == {}
    assert index.match([1, 2]) == {"a:1": 2}
    assert index.entries == 3 and index.distinct_keys == 3


def test_a_requests_whole_footprint_fills_the_lru() -> None:
    """The blocks we do not hash (the prompt's tail, the output) take room too: a long request
    pushes out old prefixes exactly as it would in the engine."""
    index = PrefixIndex()
    index.add([1, 2], "a:1", 10)
    index.add([3], "a:1", 10, extra_blocks=7)  # 1 + 7 more blocks of its own: 10 in all
    assert index.server_weight("a:1") == 10 and index.match([1, 2]) == {"a:1": 2}
    index.add([4], "a:1", 10, extra_blocks=1)  # 2 more: the oldest (2 then 1) go
    assert index.match([1]) == {} and index.match([3]) == {"a:1": 1}
    assert index.server_weight("a:1") <= 10 and index.entries == 2


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


def test_a_match_ends_at_the_first_block_an_endpoint_lacks() -> None:
    index = PrefixIndex()
    index.add([1, 2, 3, 4], "A", 100)
    index.add([1, 3, 4], "B", 100)
    assert index.match([1, 2, 3, 4]) == {"A": 4, "B": 1}
    index.add([9], "C", 100)
    assert index.match([9, 2]) == {"C": 1}
    assert index.match([5, 1]) == {}

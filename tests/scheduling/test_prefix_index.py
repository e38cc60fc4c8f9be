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
    index.touch([1, 2, 3], "a:1")  # (it ended: nothing pinned)
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
    index.touch([1, 2], "a:1")  # (each request ends before the next: nothing pinned)
    index.add([3], "a:1", 10, extra_blocks=7)  # 1 + 7 more blocks of its own: 10 in all
    index.touch([3], "a:1")
    assert index.server_weight("a:1") == 10 and index.match([1, 2]) == {"a:1": 2}
    index.add([4], "a:1", 10, extra_blocks=1)  # 2 more: the oldest (2 then 1) go
    assert index.match([1]) == {} and index.match([3]) == {"a:1": 1}
    assert index.server_weight("a:1") <= 10 and index.entries == 2


def test_eviction_on_one_endpoint_keeps_the_key_for_others() -> None:
    index = PrefixIndex()
    index.add([1], "a:1", 1)
    index.touch([1], "a:1")
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


def test_a_request_in_flight_keeps_its_blocks() -> None:
    """vLLM evicts only blocks no running request holds: a prefix whose request is still in
    flight stays, however old its pick, and the ended requests' blocks go first."""
    index = PrefixIndex()
    index.add([1, 2], "a:1", 4)  # in flight
    index.add([3, 4], "a:1", 4)
    index.touch([3, 4], "a:1")  # ended
    index.add([5, 6], "a:1", 4)  # in flight: two blocks must go
    assert index.match([1, 2]) == {"a:1": 2} and index.match([3]) == {} and index.match([5, 6]) == {"a:1": 2}
    assert index.pinned("a:1") == 4
    index.touch([1, 2], "a:1")
    index.touch([5, 6], "a:1")
    index.add([7, 8], "a:1", 4)  # now the oldest ended blocks go: 1 and 2 (ended before 5, 6)
    assert index.match([1]) == {} and index.match([5, 6]) == {"a:1": 2}


def test_pins_beyond_the_cache_stay_until_their_requests_end() -> None:
    """In deep overload a pod's queued requests name more prefixes than its cache holds; vLLM
    admits each beside a running request of its prefix, so none of them is forgotten while in
    flight. Ended ones go first, and `unpin_all` (the producer's answer to lost ends) lets the
    LRU trim to its capacity again."""
    index = PrefixIndex()
    index.add([1, 2], "a:1", 2)
    index.add([3], "a:1", 2)  # three keys in use in a capacity of two: all kept
    assert index.server_weight("a:1") == 3 and index.match([1, 2]) == {"a:1": 2} and index.match([3]) == {"a:1": 1}
    assert index.pinning("a:1") == 2
    index.touch([3], "a:1")
    index.add([4], "a:1", 2)  # the ended one goes; the in-flight ones stay
    assert index.match([3]) == {} and index.match([1, 2]) == {"a:1": 2} and index.match([4]) == {"a:1": 1}
    index.unpin_all("a:1")
    assert index.pinned("a:1") == 0 and index.pinning("a:1") == 0
    index.add([5], "a:1", 2)  # nothing pinned but 5: back within the capacity, oldest first
    assert index.server_weight("a:1") == 2 and index.match([5]) == {"a:1": 1}
    index.remove_server("a:1")
    assert index.pinned("a:1") == 0 and index.pinning("a:1") == 0


def test_an_evicted_block_is_no_longer_in_use() -> None:
    """The engine said it evicted a block (a queued request's prefix): its pin goes with it."""
    index = PrefixIndex()
    index.add([1, 2], "a:1", 10)
    index.forget([2], "a:1")
    assert index.pinned("a:1") == 1 and index.match([1, 2]) == {"a:1": 1}
    index.touch([1, 2], "a:1")
    assert index.pinned("a:1") == 0


def test_pinned_keys_are_set_aside_and_come_back_as_the_most_recent() -> None:
    """Eviction sets a pinned key aside instead of walking past it at every add (in deep
    overload a pod's pins outgrow its capacity, and every add would walk all of them); the key
    stays held and counted, and returns to the eviction order, as the most recent, when its last
    request ends — or when the producer clears the pod's pins."""
    index = PrefixIndex()
    index.add([1, 2], "a:1", 2)  # in flight
    index.add([3], "a:1", 2)  # over the capacity: 1 and 2 set aside, all three held
    assert index.server_entries("a:1") == 3 and index.server_weight("a:1") == 3 and index.entries == 3
    index.touch([3], "a:1")
    index.add([4], "a:1", 2)  # 3 (ended) goes
    assert index.match([3]) == {} and index.match([1, 2]) == {"a:1": 2}
    index.touch([1, 2], "a:1")  # their request ended before 4's: back in the order before it
    index.touch([4], "a:1")
    index.add([5], "a:1", 2)  # so 1 and 2 go, 4 stays
    assert index.match([1]) == {} and index.match([4]) == {"a:1": 1} and index.match([5]) == {"a:1": 1}
    index.add([6, 7], "a:1", 2)  # 4 goes; 5 (still in flight), 6 and 7 set aside
    index.add([8], "a:1", 2)
    assert index.server_entries("a:1") == 4 and index.match([4]) == {}
    index.forget([6], "a:1")  # the engine evicted one of them (a queued request's): gone, unpinned
    assert index.match([6]) == {} and index.server_entries("a:1") == 3 and index.server_weight("a:1") == 3
    index.unpin_all("a:1")  # 5, 7, 8 back in the order
    index.add([9], "a:1", 2)  # 5 and 7 go
    assert index.match([5]) == {} and index.match([7]) == {} and index.match([8]) == {"a:1": 1}
    assert index.server_weight("a:1") == 2 and index.pinned("a:1") == 1
    index.remove_server("a:1")
    assert index.entries == 0 and index.distinct_keys == 0

"""How a process of a multi-process run judges its peers (memjax/runtime/peer_watch.py), from
hand-made tables of what it has heard; tests/test_multihost.py kills real processes."""

from memjax.runtime import peer_watch

TIMEOUT = 30.0


def judge(me=0, now=100.0, moved=None, answered=100.0, ended=None, count=3):
    moved = {p: 100.0 for p in range(count) if p != me} if moved is None else moved
    return peer_watch.verdict(me, count, TIMEOUT, now, moved, answered, ended or {})


def test_peers_heard_within_the_timeout_are_alive():
    assert judge() is None
    assert judge(now=100.0 + TIMEOUT, moved={1: 100.0, 2: 100.0}) is None  # Exactly at the bound.


def test_the_peer_silent_longest_past_the_timeout_is_named():
    message = judge(now=140.0, moved={1: 139.0, 2: 105.0})
    assert message == 'process 2 of 3 has not been heard from for 35s (killed, or its host is gone)'
    assert judge(now=140.0, moved={1: 105.0, 2: 101.0}).startswith('process 1 of 3')  # The lowest id first.


def test_a_coordinator_that_stops_answering_is_named_by_the_others_only():
    assert judge(me=1, now=140.0, answered=105.0).startswith('process 0 of 3, the coordinator, has not answered for 35s')
    assert judge(me=0, now=140.0, answered=105.0, moved={1: 139.0, 2: 139.0}) is None  # Its own service.


def test_a_finished_peer_is_never_counted_lost():
    assert judge(now=500.0, moved={1: 100.0, 2: 499.0}, ended={1: (0, 101.0)}) is None


def test_a_peer_that_failed_stops_this_one_after_the_grace():
    """Time to fail the same way first (a NaN loss on every process) and say so in its own words;
    its failure, not its silence since, is named."""
    ended = {2: (3, 200.0)}
    assert judge(now=200.0 + peer_watch.GRACE_S, moved={1: 200.0, 2: 200.0}, ended=ended) is None
    assert (judge(now=200.0 + peer_watch.GRACE_S + 1, moved={1: 210.0, 2: 150.0}, ended=ended)
            == 'process 2 of 3 ended with exit status 3 (its log says why)')

"""How a process of a multi-process run judges its peers (memjax/runtime/peer_watch.py), from
hand-made tables of what it has heard; tests/test_multihost.py kills real processes."""

import itertools
import threading
import time

import numpy as np
import pytest

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


def heard(timeout, phases, delays, silent_from=float('inf')):
    """Replays a peer's beats and this process's reads and judgements at `beat_period(timeout)` as
    the watch's threads run them, on a clock of its own: each beat and read as late as `delays` says
    (a call to the coordinator that takes its time), the first of each at `phases`. The peer stops
    beating at `silent_from`. Returns the first judgement's time and verdict, or None."""
    period = peer_watch.beat_period(timeout)
    count = int(20 * timeout / period)
    beat_phase, read_phase, judge_phase = phases
    beats = beat_phase + period * np.arange(count) + delays[0][:count]
    reads = read_phase + period * np.arange(count) + delays[1][:count]
    moved, seen, done = {1: 0.0}, 0, 0
    for k in range(2 * count):
        now = judge_phase + k * period / 2
        while done < count and reads[done] <= now:  # The reads finished by now.
            beaten = int(np.sum(beats <= min(reads[done], silent_from)))
            if beaten != seen:
                seen, moved[1] = beaten, reads[done]
            done += 1
        if done == count:
            return None
        message = peer_watch.verdict(0, 2, timeout, now, moved, now, {})
        if message:
            return now, message
    return None


@pytest.mark.parametrize('timeout', [1, 2, 3, 6, 30])
def test_a_live_peer_is_never_judged_silent_and_a_silent_one_is_named_in_bounded_time(timeout):
    """Whatever --heartbeat_timeout says (>= 1 s), however the threads' phases fall and however
    late the coordinator answers within half a period; beats every 2 s took a timeout of 1-3 s
    for a loss."""
    period = peer_watch.beat_period(timeout)
    rng = np.random.default_rng(timeout)
    steps = [i * period / 3 for i in range(3)]
    for phases in itertools.product(steps, steps, steps):
        for _ in range(4):
            delays = rng.uniform(0, period / 2, size=(2, int(20 * timeout / period)))
            assert heard(timeout, phases, delays) is None, phases
            silent_from = 7.3 * timeout
            when, message = heard(timeout, phases, delays, silent_from)
            # wait_for_verdict's bound: the timeout and two periods after the last beat.
            assert silent_from < when <= silent_from + timeout + 2 * period, (when, silent_from)
            assert message.startswith('process 1 of 2 has not been heard from for')


class _Store:
    """The coordination service's key-value store, as the watch calls it."""

    def __init__(self):
        self.values, self.lock = {}, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):  # pylint: disable=unused-argument
        with self.lock:
            self.values[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_process_0_ends_after_the_others_have_said_they_end(monkeypatch):
    """Its end takes the coordination service, and with it every other process's JAX client (an
    abort instead of their own line and status): it waits until they have said they end, at most
    _LAST_WORDS_S when one does not."""
    store = _Store()
    watch = peer_watch._Watch(store, 0, 3, TIMEOUT)  # pylint: disable=protected-access
    peers_done = threading.Event()

    def peers():
        store.key_value_set('memjax/peers/ended/1', '2')
        time.sleep(0.5)
        store.key_value_set('memjax/peers/ended/2', '2')
        peers_done.set()

    threading.Thread(target=peers, daemon=True).start()
    watch.end(2)
    assert peers_done.is_set() and store.values['memjax/peers/ended/0'] == '2'
    assert peer_watch.all_ended(store.key_value_dir_get('memjax/peers/'), 0, 3)
    assert not peer_watch.all_ended([('memjax/peers/ended/1', '0'), ('memjax/peers/beat/2', '7')], 0, 3)
    # A peer that never says so does not hold the end up beyond the bound.
    monkeypatch.setattr(peer_watch, '_LAST_WORDS_S', 0.3)
    alone = _Store()
    started = time.monotonic()
    peer_watch._Watch(alone, 0, 2, TIMEOUT).end(0)  # pylint: disable=protected-access
    assert time.monotonic() - started < 5.0 and 'memjax/peers/ended/0' in alone.values

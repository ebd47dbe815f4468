# SPDX-License-Identifier: Apache-2.0
"""SaveQueue: copies in order, commits after their copy, fences, failures, draining close."""

from __future__ import annotations

import threading

import pytest

from lmcache_vllm.worker.save_queue import ReadFence, SaveQueue


def test_copies_in_order_commits_after_their_copy():
    q = SaveQueue()
    events: list[str] = []

    def job(name: str):
        def copy():
            events.append(f"copy {name}")
            return lambda: events.append(f"commit {name}")

        return copy

    for name in ("a", "b", "c"):
        q.submit(name, job(name))
    assert q.wait(timeout=5)
    copies = [e for e in events if e.startswith("copy")]
    assert copies == ["copy a", "copy b", "copy c"]
    for name in "abc":
        assert events.index(f"copy {name}") < events.index(f"commit {name}")
    assert q.close()


def test_wait_read_does_not_wait_for_commits():
    """The step fence waits for the pages to be read, not for the checksum + publish."""
    q = SaveQueue()
    commit_gate = threading.Event()
    copied = threading.Event()

    def copy():
        copied.set()
        return lambda: commit_gate.wait(5)

    q.submit("r", copy)
    assert q.wait_read(timeout=5) == [] and copied.is_set()
    assert not q.wait(timeout=0.2)  # the commit is still blocked
    commit_gate.set()
    assert q.wait(timeout=5)
    assert q.close()


def test_wait_read_waits_for_a_running_copy():
    q = SaveQueue()
    gate = threading.Event()
    q.submit("slow", lambda: (gate.wait(5), None)[1])
    assert q.wait_read(timeout=0.2) is None
    gate.set()
    assert q.wait_read(timeout=5) == []
    assert q.close()


def test_a_copy_that_releases_its_fence_early_hands_back_its_event_once():
    """A deferred copy releases its fence (with the event its pages are read after) while
    it still runs: the fence returns at once, with that event, and never again."""
    q = SaveQueue()
    gate = threading.Event()
    fence = ReadFence()
    marker = object()  # stands for the CUDA event

    def copy():
        fence.release(marker)
        gate.wait(5)  # the rest of the job (its transfer) still runs
        return None

    q.submit("early", copy, fence)
    assert q.wait_read(timeout=5) == [marker]
    assert q.wait_read(timeout=5) == []  # handed out once
    assert not q.wait(timeout=0.1)  # the job itself is still running
    gate.set()
    assert q.wait(timeout=5)
    assert q.close()


def test_a_failing_copy_releases_its_fence():
    q = SaveQueue()

    def bad():
        raise RuntimeError("device error")

    q.submit("bad", bad)
    assert q.wait_read(timeout=5) == []
    assert q.close()


def test_failures_are_dropped_and_the_threads_survive(caplog):
    q = SaveQueue()
    ran: list[str] = []

    def bad_copy():
        raise RuntimeError("device error")

    def bad_commit():
        def commit():
            raise OSError("tier error")

        return commit

    q.submit("x", bad_copy)
    q.submit("y", bad_commit)
    q.submit("z", lambda: lambda: ran.append("z"))
    assert q.wait(timeout=5)
    assert ran == ["z"]
    assert "save of request x failed" in caplog.text and "save of request y failed" in caplog.text
    assert q.close()


def test_close_drains_then_refuses():
    q = SaveQueue()
    ran: list[int] = []
    for i in range(20):
        q.submit(f"r{i}", lambda i=i: lambda: ran.append(i))
    assert q.close(timeout=10)
    assert sorted(ran) == list(range(20))
    with pytest.raises(RuntimeError, match="after close"):
        q.submit("late", lambda: None)


class _Event:
    """A stand-in for a CUDA event: ``query()`` is whether the forward is done."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _timed_wait(gate) -> float:
    import time

    start = time.monotonic()
    gate.wait()
    return time.monotonic() - start


def _held_waiter(gate) -> tuple[threading.Thread, list[float]]:
    """A thread in ``gate.wait()``, started and held back (``took`` gets its wait)."""
    import time

    took: list[float] = []
    waiter = threading.Thread(target=lambda: took.append(_timed_wait(gate)))
    waiter.start()
    deadline = time.monotonic() + 5.0
    while not gate.waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    assert gate.waiting
    return waiter, took


def test_gate_lets_a_commit_run_while_a_forward_is_in_flight():
    from lmcache_vllm.worker.save_queue import QuietGate

    gate = QuietGate(max_wait_s=5.0)
    gate.forward_enqueued(_Event(done=False))
    assert _timed_wait(gate) < 1.0
    assert not gate.waiting


def test_gate_holds_a_commit_until_the_next_forward_or_its_deadline():
    from lmcache_vllm.worker.save_queue import QuietGate

    gate = QuietGate(max_wait_s=0.2)
    gate.forward_enqueued(_Event(done=True))  # the GPU finished: vLLM's thread is busy
    assert _timed_wait(gate) >= 0.19  # nothing came: runs at its deadline

    gate.max_wait_s = 5.0
    waiter, took = _held_waiter(gate)
    gate.forward_enqueued(_Event(done=False))  # the next forward is enqueued
    waiter.join(5.0)
    assert took and took[0] < 1.0


@pytest.mark.parametrize("how", ["hurry", "close"])
def test_gate_holds_nothing_back_when_hurried_or_closed(how):
    from lmcache_vllm.worker.save_queue import QuietGate

    gate = QuietGate(max_wait_s=5.0)
    waiter, took = _held_waiter(gate)
    if how == "close":
        gate.close()
        waiter.join(5.0)
    else:
        with gate.hurry():
            waiter.join(5.0)
    assert took and took[0] < 1.0
    if how == "close":
        assert _timed_wait(gate) < 1.0  # stays open


def test_queue_wait_hurries_a_held_commit():
    """A reset (``SaveQueue.wait``) does not wait out the gate's deadline."""
    import time

    q = SaveQueue("t")
    q.gate.max_wait_s = 30.0
    q.gate.forward_enqueued(_Event(done=True))
    published: list[str] = []

    def commit() -> None:
        q.gate.wait()
        published.append("a")

    q.submit("a", lambda: commit)
    start = time.monotonic()
    assert q.wait(timeout=10.0)
    assert published == ["a"]
    assert time.monotonic() - start < 5.0
    assert q.close(timeout=5.0)


def test_a_lookup_waiting_for_an_unpublished_save_hurries_only_while_it_waits():
    from lmcache_vllm.worker.save_queue import UnpublishedSaves

    saves = UnpublishedSaves(chunk_size=4)
    entered: list[str] = []

    class _Hurry:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    job = saves.add("", [1, 2, 3, 4, 5, 6, 7, 8])
    assert not saves.wait_for("", [9, 9, 9, 9], 0, timeout=0.01, hurry=_Hurry)
    assert entered == []  # no save it needs: no hurry
    threading.Timer(0.05, saves.done, (job,)).start()
    assert saves.wait_for("", [1, 2, 3, 4, 5, 6, 7, 8], 0, timeout=5.0, hurry=_Hurry)
    assert entered == ["in", "out"]


def test_a_lookup_waits_only_for_saves_that_extend_its_hit():
    """``wait_for``'s match against its definition (same salt, the same tokens through the
    first missing chunk), over random saves built to share first/last tokens and lengths."""
    import random

    from lmcache_vllm.worker.save_queue import UnpublishedSaves

    rng = random.Random(0)
    for _ in range(300):
        saves = UnpublishedSaves(chunk_size=4)
        query = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        found = rng.randrange(0, len(query) + 1) // 4 * 4
        salt = rng.choice(["", "t"])
        stored = []
        for _ in range(rng.randrange(0, 4)):
            tokens = list(query[: rng.randrange(0, len(query) + 1)])
            tokens += [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
            if tokens and rng.random() < 0.5:
                tokens[rng.randrange(len(tokens))] = rng.randrange(3)
            s = rng.choice(["", "t"])
            stored.append((s, tokens))
            saves.add(s, tokens)
        cut = min(len(query), (found // 4 + 1) * 4)
        want = any(s == salt and t[:cut] == query[:cut] and len(t) >= cut for s, t in stored)
        assert saves.wait_for(salt, query, found, timeout=0.0) == want, (query, found, stored)

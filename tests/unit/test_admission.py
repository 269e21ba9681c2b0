"""app/engine/admission.py without a model: slots, the bounded queue (429), the queue timeout (503), order. Admission
raises engine errors; the statuses and messages are the HTTP layer's answer to them (``from_engine``)."""

from __future__ import annotations

import threading

import pytest

from app.engine.admission import Admission
from app.engine.errors import QueueFull, QueueTimeout
from app.errors import from_engine


def wait_for(predicate, timeout: float = 10.0) -> None:
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    try:
        while not predicate():
            if done.wait(0.001):
                raise AssertionError("condition not reached")
    finally:
        deadline.cancel()


class Waiter(threading.Thread):
    """A thread that takes a slot, records it, and holds it until released."""

    def __init__(self, admission: Admission, name: str, log: list[str]):
        super().__init__(daemon=True)
        self.admission, self.name_, self.log = admission, name, log
        self.release = threading.Event()
        self.error: Exception | None = None
        self.entered = threading.Event()

    def run(self):
        try:
            with self.admission.slot():
                self.log.append(self.name_)
                self.entered.set()
                self.release.wait(10)
        except Exception as exc:
            self.error = exc
            self.entered.set()


def test_free_slot_is_taken_at_once_and_given_back():
    admission = Admission(max_queue=0, timeout=1)
    with admission.slot():
        assert admission.snapshot() == {"active": 1, "waiting": 0, "rejected": 0, "timed_out": 0}
    assert admission.snapshot()["active"] == 0
    with admission.slot():
        pass


def test_slot_is_given_back_when_the_body_raises():
    admission = Admission(max_queue=0)
    with pytest.raises(RuntimeError):
        with admission.slot():
            raise RuntimeError("boom")
    assert admission.active == 0
    with admission.slot():
        assert admission.active == 1


def test_full_queue_is_429_with_retry_after_and_the_limit_in_the_message():
    admission = Admission(max_queue=1, timeout=30)
    log: list[str] = []
    holder = Waiter(admission, "holder", log)
    holder.start()
    assert holder.entered.wait(10)
    queued = Waiter(admission, "queued", log)
    queued.start()
    wait_for(lambda: admission.waiting == 1)
    with pytest.raises(QueueFull) as info:
        with admission.slot():
            pass
    assert (info.value.waiting, info.value.limit) == (1, 1)
    err = from_engine(info.value)
    assert err.status == 429 and err.code == "model_overloaded"
    assert "model is overloaded" in err.message and "SAKER_MAX_QUEUE=1" in err.message
    assert 1 <= int(err.headers["Retry-After"]) <= 60
    assert err.body()["error"]["type"] == "server_overloaded"
    holder.release.set()
    assert queued.entered.wait(10)
    queued.release.set()
    holder.join(10)
    queued.join(10)
    assert log == ["holder", "queued"] and queued.error is None
    assert admission.snapshot() == {"active": 0, "waiting": 0, "rejected": 1, "timed_out": 0}


def test_max_queue_zero_rejects_whenever_busy():
    admission = Admission(max_queue=0)
    with admission.slot():
        with pytest.raises(QueueFull):
            admission.acquire()
    with admission.slot():
        pass


def test_waiting_longer_than_the_timeout_is_503():
    admission = Admission(max_queue=4, timeout=0.05)
    with admission.slot():
        with pytest.raises(QueueTimeout) as info:
            with admission.slot():
                pass
    assert info.value.limit_s == 0.05 and info.value.waited_s >= 0.05
    err = from_engine(info.value)
    assert err.status == 503 and err.code == "queue_timeout" and err.type == "service_unavailable"
    assert "SAKER_QUEUE_TIMEOUT=0.05" in err.message and "Retry-After" in err.headers
    assert admission.snapshot() == {"active": 0, "waiting": 0, "rejected": 0, "timed_out": 1}
    with admission.slot():  # nothing leaked
        pass


def test_waiters_are_served_first_come_first_served():
    admission = Admission(max_queue=10, timeout=30)
    log: list[str] = []
    first = Waiter(admission, "first", log)
    first.start()
    assert first.entered.wait(10)
    waiters = []
    for i in range(5):
        w = Waiter(admission, f"w{i}", log)
        w.start()
        wait_for(lambda i=i: admission.waiting == i + 1)
        waiters.append(w)
    first.release.set()
    for w in waiters:
        assert w.entered.wait(10)
        w.release.set()
    for w in [first, *waiters]:
        w.join(10)
    assert log == ["first", "w0", "w1", "w2", "w3", "w4"]


def test_many_threads_never_exceed_capacity_and_every_one_is_answered():
    admission = Admission(max_queue=3, timeout=30, capacity=2)
    peak = {"active": 0, "inside": 0}  # counted by the clients themselves, not read from the admission
    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(24)

    def client():
        start.wait()
        for _ in range(20):
            try:
                with admission.slot():
                    with lock:
                        peak["inside"] += 1
                        peak["active"] = max(peak["active"], peak["inside"])
                    outcomes.append("ok")
                    with lock:
                        peak["inside"] -= 1
            except QueueFull:
                outcomes.append("429")

    threads = [threading.Thread(target=client) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(outcomes) == 24 * 20
    assert peak["active"] <= 2
    assert outcomes.count("ok") >= 1
    assert admission.snapshot()["active"] == 0 and admission.snapshot()["waiting"] == 0
    assert admission.snapshot()["rejected"] == outcomes.count("429")


def test_unbounded_by_default():
    admission = Admission()
    assert admission.max_queue is None and admission.timeout is None
    log: list[str] = []
    holder = Waiter(admission, "holder", log)
    holder.start()
    assert holder.entered.wait(10)
    waiters = [Waiter(admission, f"w{i}", log) for i in range(20)]
    for w in waiters:
        w.start()
    wait_for(lambda: admission.waiting == 20)
    holder.release.set()
    for w in waiters:
        w.release.set()
    for w in [holder, *waiters]:
        w.join(10)
    assert len(log) == 21 and all(w.error is None for w in waiters)


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"max_queue": -1}, {"timeout": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        Admission(**kwargs)


def test_retry_after_grows_with_the_queue_and_is_bounded():
    admission = Admission(max_queue=100)
    with admission.slot():
        pass
    admission._mean_hold_s = 2.0
    admission.waiting = 0
    assert admission.retry_after_s() == 2
    admission.waiting = 9
    assert admission.retry_after_s() == 20
    admission.waiting = 1000
    assert admission.retry_after_s() == 60
    admission._mean_hold_s = 0.001
    admission.waiting = 0
    assert admission.retry_after_s() == 1


@pytest.mark.parametrize("max_queue", [10, 1])
def test_newcomer_queues_behind_the_waiter_the_slot_was_handed_to(max_queue):
    """Releasing hands the slot to the oldest waiter at once: a request that arrives just as the slot is freed
    still waits behind the ones already queued, and at exactly a full queue (``max_queue`` 1) it sees a queue with
    room (not the 429 a full queue gives) and queues behind it."""
    admission = Admission(max_queue=max_queue, timeout=30)
    log: list[str] = []
    admission.acquire()  # the running request
    queued = Waiter(admission, "queued", log)
    queued.start()
    wait_for(lambda: admission.waiting == 1)
    with admission._cond:  # the slot moves on; the newcomer arrives before the waiter runs
        admission.release()
        assert admission.waiting == 0 and admission.active == 1
        newcomer = Waiter(admission, "newcomer", log)
        newcomer.start()
    assert queued.entered.wait(10)
    queued.release.set()
    assert newcomer.entered.wait(10)
    newcomer.release.set()
    for w in (queued, newcomer):
        w.join(10)
    assert newcomer.error is None and queued.error is None
    assert log == ["queued", "newcomer"]
    assert admission.snapshot() == {"active": 0, "waiting": 0, "rejected": 0, "timed_out": 0}

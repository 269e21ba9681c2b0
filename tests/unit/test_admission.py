"""app/engine/core/admission.py without a model: the scheduler's waiting-queue rules (running slots, the bounded queue's
429, the queue timeout's 503, first come first served). Admission raises engine errors; the statuses and messages
are the HTTP layer's answer to them (``from_engine``). The scheduler with a model under the same rules: tests/http
(test_ops.py: 429 and 503 over HTTP) and tests/engine/test_continuous_batching.py (the queue in the scheduler)."""

from __future__ import annotations

import random

import pytest

from app.engine.core.admission import Admission
from app.engine.errors import QueueFull, QueueTimeout
from app.errors import from_engine


def test_a_free_slot_is_taken_at_once_and_given_back():
    admission = Admission(max_queue=0, timeout=1)
    assert admission.arrive(1, 0.0) and admission.holds(1)
    assert admission.snapshot() == {"active": 1, "waiting": 0, "rejected": 0, "timed_out": 0}
    assert admission.leave(1, 1.0) is None
    assert admission.snapshot()["active"] == 0 and not admission.holds(1)
    assert admission.arrive(2, 2.0)


def test_a_full_queue_is_429_with_retry_after_and_the_limit_in_the_message():
    admission = Admission(max_queue=1, timeout=30)
    assert admission.arrive(1, 0.0)
    assert not admission.arrive(2, 0.0)  # waits
    with pytest.raises(QueueFull) as info:
        admission.arrive(3, 0.0)
    assert (info.value.waiting, info.value.limit) == (1, 1)
    err = from_engine(info.value)
    assert err.status == 429 and err.code == "model_overloaded"
    assert "model is overloaded" in err.message and "SAKER_MAX_QUEUE=1" in err.message
    assert 1 <= int(err.headers["Retry-After"]) <= 60
    assert err.body()["error"]["type"] == "server_overloaded"
    assert admission.leave(1, 1.0) == 2  # the slot goes to the waiter
    assert admission.holds(2) and not admission.holds(3)
    admission.leave(2, 2.0)
    assert admission.snapshot() == {"active": 0, "waiting": 0, "rejected": 1, "timed_out": 0}


def test_max_queue_zero_rejects_whenever_busy():
    admission = Admission(max_queue=0)
    admission.arrive(1, 0.0)
    with pytest.raises(QueueFull):
        admission.arrive(2, 0.0)
    admission.leave(1, 0.5)
    assert admission.arrive(3, 1.0)


def test_waiting_longer_than_the_timeout_is_503():
    admission = Admission(max_queue=4, timeout=0.05)
    admission.arrive(1, 0.0)
    assert not admission.arrive(2, 0.01)
    assert admission.next_deadline() == pytest.approx(0.06)
    assert admission.expired(0.05) == []  # not yet
    [(rid, error)] = admission.expired(0.07)
    assert rid == 2 and isinstance(error, QueueTimeout)
    assert error.limit_s == 0.05 and error.waited_s == pytest.approx(0.06)
    err = from_engine(error)
    assert err.status == 503 and err.code == "queue_timeout" and err.type == "service_unavailable"
    assert "SAKER_QUEUE_TIMEOUT=0.05" in err.message and "Retry-After" in err.headers
    assert admission.snapshot() == {"active": 1, "waiting": 0, "rejected": 0, "timed_out": 1}
    assert admission.leave(1, 0.1) is None  # nothing leaked: the timed-out request got no slot
    assert admission.next_deadline() is None and admission.arrive(3, 0.2)


def test_a_waiter_that_leaves_gives_up_its_place():
    admission = Admission(max_queue=2)
    admission.arrive(1, 0.0)
    admission.arrive(2, 0.0)
    admission.arrive(3, 0.0)
    assert admission.leave(2, 0.5) is None  # cancelled while it waited
    assert admission.waiting == 1
    assert admission.leave(1, 1.0) == 3


def test_slots_go_first_come_first_served_up_to_capacity():
    """A random interleaving of arrivals and ends on capacity 3: the running set never exceeds it, and the order
    in which requests get their slots is the order they arrived (a model of the queue: a list)."""
    rng = random.Random(5)
    admission = Admission(capacity=3)
    running: list[int] = []
    order: list[int] = []
    waiting: list[int] = []
    for rid in range(200):
        if running and rng.random() < 0.5:
            leaving = running.pop(rng.randrange(len(running)))
            granted = admission.leave(leaving, float(rid))
            expected = waiting.pop(0) if waiting else None
            assert granted == expected
            if granted is not None:
                running.append(granted)
                order.append(granted)
        if admission.arrive(rid, float(rid)):
            assert not waiting
            running.append(rid)
            order.append(rid)
        else:
            waiting.append(rid)
        assert admission.active == len(running) <= 3 and admission.waiting == len(waiting)
    assert order == sorted(order)


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"max_queue": -1}, {"timeout": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        Admission(**kwargs)


def test_retry_after_grows_with_the_queue_and_is_bounded():
    admission = Admission(max_queue=100)
    admission.arrive(0, 0.0)
    admission.leave(0, 2.0)  # one request held its slot 2 s
    assert admission.retry_after_s() == 2
    admission.arrive(1, 3.0)
    for rid in range(2, 11):
        admission.arrive(rid, 3.0)
    assert admission.waiting == 9 and admission.retry_after_s() == 20
    for rid in range(11, 101):
        admission.arrive(rid, 3.0)
    assert admission.retry_after_s() == 60
    fresh = Admission()
    fresh.arrive(0, 0.0)
    fresh.leave(0, 0.001)
    assert fresh.retry_after_s() == 1

"""The engine's errors (app/engine/errors.py: plain data) and the HTTP layer's answer to each (app.errors.from_engine):
status, headers, type, code, param and message, as the server answered before the engine stopped building them."""

from __future__ import annotations

import pickle

import pytest

from app.engine.errors import (
    ClientGone,
    ConstraintError,
    EngineError,
    EngineNotReady,
    EngineOutOfMemory,
    QueueFull,
    QueueTimeout,
)
from app.errors import (
    APIError,
    ClientClosedError,
    InternalServerError,
    InvalidRequestError,
    as_api_error,
    engine_errors_as_api,
    from_engine,
)


def test_queue_full_is_429_model_overloaded_naming_saker_max_queue():
    err = from_engine(QueueFull(waiting=8, limit=8, retry_after_s=3))
    assert err.status == 429 and err.headers == {"Retry-After": "3"}
    assert err.body() == {
        "error": {
            "message": "The model is overloaded: 8 requests are already waiting for it, the most allowed "
            "(SAKER_MAX_QUEUE=8). Retry after 3 s.",
            "type": "server_overloaded",
            "param": None,
            "code": "model_overloaded",
        }
    }


def test_queue_timeout_is_503_queue_timeout_naming_saker_queue_timeout():
    err = from_engine(QueueTimeout(waited_s=120.0004, limit_s=120.0, retry_after_s=60))
    assert err.status == 503 and err.headers == {"Retry-After": "60"}
    assert err.body() == {
        "error": {
            "message": "The model is overloaded: this request waited 120 s for its turn, the longest allowed "
            "(SAKER_QUEUE_TIMEOUT=120). Retry after 60 s.",
            "type": "service_unavailable",
            "param": None,
            "code": "queue_timeout",
        }
    }
    assert "SAKER_QUEUE_TIMEOUT=0.05" in from_engine(QueueTimeout(0.0512, 0.05, 1)).message


def test_out_of_memory_is_503_out_of_memory_with_retry_after_1():
    err = from_engine(EngineOutOfMemory("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert err.status == 503 and err.headers == {"Retry-After": "1"}
    assert err.body()["error"] == {
        "message": "The server ran out of accelerator memory for this request and freed it again; retry, or ask "
        "for fewer tokens (prompt, max_tokens, n, best_of)",
        "type": "service_unavailable",
        "param": None,
        "code": "out_of_memory",
    }
    assert "2.00 GiB" not in err.message  # the device's own words go to the log, not to the client


def test_not_ready_is_503_model_not_ready_with_the_reason():
    err = from_engine(EngineNotReady("the model is still loading; retry shortly"))
    assert err.status == 503 and err.headers == {"Retry-After": "5"}
    assert err.body()["error"] == {
        "message": "the model is still loading; retry shortly",
        "type": "service_unavailable",
        "param": None,
        "code": "model_not_ready",
    }


def test_client_gone_is_499_and_keeps_the_timings():
    gone = ClientGone()
    gone.timings = object()
    err = from_engine(gone)
    assert isinstance(err, ClientClosedError) and err.status == 499 and err.timings is gone.timings
    assert err.body()["error"]["code"] == "client_closed_request"
    assert err.message == "the client closed the connection; generation stopped"


def test_a_constraint_error_is_a_400_and_the_service_names_the_field():
    err = from_engine(ConstraintError("regex: unexpected end"))
    assert isinstance(err, InvalidRequestError) and err.status == 400 and err.message == "regex: unexpected end"


def test_an_unknown_engine_error_is_a_500():
    class Odd(EngineError):
        pass

    err = from_engine(Odd("something"))
    assert isinstance(err, InternalServerError) and err.status == 500 and "something" in err.message


@pytest.mark.parametrize(
    "error",
    [
        QueueFull(3, 2, 7),
        QueueTimeout(1.5, 1.0, 4),
        EngineOutOfMemory("CUDA out of memory"),
        EngineNotReady("the engine process exited (code -9)"),
        ClientGone(),
        ConstraintError("bad schema"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_engine_error_crosses_the_engine_process_pipe_whole(error):
    """The engine process pickles a group's failure (engine_process._picklable): each error comes back
    with its fields and the same answer."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and vars(back) == vars(error) and str(back) == str(error)
    assert from_engine(back).body() == from_engine(error).body()
    assert from_engine(back).headers == from_engine(error).headers
    assert not isinstance(error, APIError)  # plain data: no status, no body


def test_engine_errors_as_api_maps_in_a_generator_and_leaves_the_rest():
    def chunks():
        with engine_errors_as_api():
            yield 1
            raise QueueFull(1, 1, 2)

    stream = chunks()
    assert next(stream) == 1
    with pytest.raises(APIError) as info:
        next(stream)
    assert info.value.status == 429 and info.value.__suppress_context__

    with pytest.raises(ValueError):
        with engine_errors_as_api():
            raise ValueError("not the engine's")
    closed = chunks()
    next(closed)
    closed.close()  # GeneratorExit passes through untouched

    api = InvalidRequestError("bad")
    assert as_api_error(api) is api and as_api_error(EngineNotReady("x")).status == 503

"""``Worker.load``: the model is loaded on a thread of its own that is gone when ``load`` returns, so that the
scheduler thread is the only long-lived owner of torch's CPU thread pool (see the method's docstring: a second
pool made decode twice as slow on 2 cores); a load error still reaches the caller."""

from __future__ import annotations

import threading

import pytest

from app.engine.model.load_config import LoadConfig
from app.engine.model.loader import load_model
from app.engine.params import SamplingParams
from app.engine.core.worker import Worker
from app.errors import ConfigError


def test_the_model_loads_on_a_thread_that_exits(gpt2_dir):
    seen: list[threading.Thread] = []

    def loader():
        seen.append(threading.current_thread())
        return load_model(LoadConfig(model=str(gpt2_dir)))

    worker = Worker(("tiny-gpt2",), loader)
    worker.load()
    assert worker.ready
    [thread] = seen
    assert thread is not threading.current_thread() and thread.name == "saker-load"
    assert not thread.is_alive()
    (out,), _ = worker.complete([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), 64)
    assert len(out.choices[0].token_ids) == 2


def test_a_load_error_reaches_the_caller():
    def broken():
        raise ConfigError("model directory /nowhere does not exist")

    worker = Worker(("m",), broken)
    with pytest.raises(ConfigError, match="/nowhere does not exist"):
        worker.load()
    assert not worker.ready and worker.error == "model directory /nowhere does not exist"


def test_an_engine_process_leaves_one_core_to_the_serving_process(monkeypatch):
    """As vLLM's CPU worker: the model loop's threads are the cores this process may use, one fewer in an engine
    process of its own; a number asked for is taken as it is; in one process torch's default stays."""
    import os

    from app.engine.core.startup import engine_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert engine_threads(None, True) == 3
    assert engine_threads(None, False) is None
    assert engine_threads(2, False) == 2 and engine_threads(5, True) == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert engine_threads(None, True) == 1


def test_the_load_sizes_torchs_pool_before_the_engine_thread_first_runs(monkeypatch):
    import torch

    from app.engine.core.startup import EngineConfig, load_engine

    sizes = []
    monkeypatch.setattr(torch, "set_num_threads", sizes.append)

    def broken():
        raise ConfigError("no model")

    with pytest.raises(ConfigError):
        load_engine(("m",), broken, EngineConfig(threads=3))
    with pytest.raises(ConfigError):
        load_engine(("m",), broken, EngineConfig())
    assert sizes == [3]


def test_what_lives_as_long_as_the_engine_is_out_of_the_collectors_sight(gpt2_dir):
    """``startup.freeze_heap``: the loaded model, its modules and the tokenizer are frozen (``gc.freeze``) before the
    engine serves, so that a full collection while serving does not walk them (a 200-ms pause on part E's load);
    what a request makes afterwards is still collected."""
    import gc

    worker = Worker(("tiny-gpt2",), lambda: load_model(LoadConfig(model=str(gpt2_dir))))
    worker.load()
    model = worker.runner.model
    tracked = {id(o) for o in gc.get_objects()}  # the generations' objects: the frozen ones are in none of them
    assert id(model) not in tracked and id(next(model.modules())) not in tracked
    assert id(worker.runner.tokenizer) not in tracked

    class Later:
        pass

    later = Later()
    assert any(o is later for o in gc.get_objects())

"""The completion service (app/service.py) without a model: the system fingerprint."""

from __future__ import annotations


def test_system_fingerprint_is_stable_and_follows_weights_and_settings():
    from types import SimpleNamespace

    from app.service import CompletionService
    from app.settings import Settings

    info = SimpleNamespace(source="/models/a", precision="float32", adapters=(), vocab_size=400, context_length=256)
    worker = SimpleNamespace(require_ready=lambda: info)

    def fingerprint(settings, source="/models/a"):
        info.source = source
        return CompletionService(settings, worker).system_fingerprint

    base = fingerprint(Settings(dtype="float32"))
    assert base.startswith("fp_") and base == fingerprint(Settings(dtype="float32"))
    assert fingerprint(Settings(dtype="bfloat16")) != base
    assert fingerprint(Settings(dtype="float32"), source="/models/b") != base

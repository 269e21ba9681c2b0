"""What a reliability run does: the sections, the prompts, and the plan's sizes (full or ``--quick``)."""

from __future__ import annotations

from dataclasses import dataclass

from app.processes import ROOT

DEFAULT_CACHE = ROOT / ".cache" / "saker"
DEFAULT_OUT = ROOT / ".cache" / "reliability" / "reliability.json"
SECTIONS = ("load", "bad", "slow", "memory", "close")
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three colours:",
    "def add(a, b):",
    "Hello there, how are you today?",
]


@dataclass
class Plan:
    levels: tuple[int, ...] = (16, 32, 64)
    load_seconds: float = 60.0
    drop_every: int = 4  # one client in this many drops its requests
    values: str = "full"  # the wrong-type values tried in every field: full or quick
    slow_clients: int = 200
    slow_seconds: float = 60.0
    slow_interval: float = 2.0
    memory_variants: tuple[str, ...] = ("worst", "fits", "scoring")
    close_cases: tuple[str, ...] = (
        "stream-decode",
        "plain-decode",
        "plain-stop-decode",
        "stream-prefill",
        "plain-prefill",
        "stream-long-prefill",
    )
    close_after: float = 1.0

    @classmethod
    def quick(cls) -> "Plan":
        return cls(
            levels=(16, 64),
            load_seconds=5.0,
            values="quick",
            slow_clients=50,
            slow_seconds=20.0,
            memory_variants=("fits",),
            close_cases=("stream-decode", "plain-decode"),
        )

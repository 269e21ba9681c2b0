"""What a reliability run does: the sections, the prompts, and the plan's sizes (full or ``--quick``)."""

from __future__ import annotations

from dataclasses import dataclass

from tooling.processes import ROOT

DEFAULT_CACHE = ROOT / ".cache" / "saker"
DEFAULT_OUT = ROOT / ".cache" / "reliability" / "reliability.json"
SECTIONS = ("load", "bad", "slow", "memory", "close", "wedge")
# the file whose content is the wedge section's fault rate (tooling/reliability/faults.py); not a SAKER_ name: it is
# the reliability run's, not a setting of saker
FAULT_FILE = "RELIABILITY_FAULT_FILE"
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
    wedge_max_tokens: tuple[int, ...] = (1, 2, 16, 200)  # the wide requests' max_tokens (n = best_of = max_n)
    wedge_beside_max_tokens: tuple[int, ...] = (1, 2, 16, 200)  # those sent again beside other traffic
    wedge_clients: int = 3  # closed-loop clients beside the wide requests
    wedge_request_timeout: float = 600.0
    fault_modes: tuple[str, ...] = ("in-process", "engine-process")  # the second server: SAKER_ENGINE_PROCESS off/on
    fault_rate: float = 0.02  # each fault point of a step (rows, flat, sample) fails with this probability
    fault_seconds: float = 30.0  # then on until fault_least steps failed (at most 6 x as long)
    fault_least: int = 20
    fault_clients: int = 4
    fault_request_timeout: float = 120.0  # a request unanswered this long is a hang

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
            wedge_max_tokens=(1, 2, 16),
            wedge_beside_max_tokens=(1,),
            wedge_request_timeout=120.0,
            fault_modes=("in-process",),
            fault_seconds=5.0,
            fault_least=5,
            fault_request_timeout=60.0,
        )

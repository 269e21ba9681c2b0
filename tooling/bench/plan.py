"""What one run does: the ``Plan`` (how many requests, tokens, repetitions and seconds each part gets; full or
``--quick``), the goals the ratios are judged against, and where things go."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "docs" / "performance"
DEFAULT_CACHE = ROOT / ".cache" / "bench"
SCHEMA = 1  # of bench.json

GOALS = {
    "A": ("<=", 0.7),
    "B": (">=", 2.2),
    "C": ("<=", 5.0),
    "D": ("<=", 1.3),
    "E greedy": (">=", 0.7),
    "E sampled": (">=", 0.6),
    "S 1 client": (">=", 0.9),
    "S 8 clients": (">=", 0.9),
    "K 1 client": ("<=", 1.0),  # saker's decode ms/token / llama.cpp's
    "K 8 clients": (">=", 1.5),  # saker's tokens/s / llama.cpp's
    "K 32 clients": (">=", 1.5),
    "M": ("<=", 3.0),  # the decoding streams' inter-token latency p99 / p50 while long prompts arrive
    # V: saker / vLLM's CPU build (bf16), output tokens/s at 1, 8 and 32 clients, saker in bf16 and in int4 each
    "V bf16 tokens/s": (">=", 1.0),
    "V int4 tokens/s": (">=", 1.0),
    # V, the mixed-length load (16 clients): saker / vLLM
    "V mixed tokens/s": (">=", 1.2),
    "V mixed TTFT p99": ("<=", 0.8),
    "V mixed ITL p99": ("<=", 1.0),
    # P: speculative decoding (ngram) / off, output tokens/s: 1 client on an input-grounded and a free-form task, and
    # 32 clients of the free-form one
    "P grounded": (">=", 2.0),
    "P free": (">=", 0.97),
    "P 32 clients": (">=", 1.0),
    # F: saker's decode step / the machine's floor for it (SmolLM2 as served, in process): 1 row / (weight bytes /
    # memory bandwidth), 32 rows / (2 x parameters x 32 / float32 matmul throughput)
    "F 1 row": ("<=", 1.5),
    "F 32 rows": ("<=", 1.5),
}

# A repetition during which other processes used more than this share of the CPU does not count (shared machines);
# it is still recorded in the JSON, with its share.
CLEAN_SHARE = 0.10


def check_goal(part: str, value: float | None) -> bool | None:
    if value is None or part not in GOALS or (isinstance(value, float) and math.isnan(value)):
        return None
    op, goal = GOALS[part]
    return value <= goal if op == "<=" else value >= goal


@dataclass
class Plan:
    """How much of everything one run does (full or --quick)."""

    prompt_tokens: int = 64
    a_tokens: int = 32
    a_reps: int = 9
    warmup: int = 2
    b_tokens: int = 32
    b_rounds: int = 3
    b_single_requests: int = 4  # requests of the 1-client run, per round
    b_clients: int = 8
    b_per_client: int = 2  # requests per client in the 8-client run, per round
    c_rounds: int = 10
    c_per_round: int = 30
    t_tokens: int = 16
    t_reps: int = 9
    l_levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    l_tokens: int = 16
    l_requests: int = 24  # requests per level (at least 2 per client)
    l_level_seconds: float = 30.0  # no new requests after this long at one level
    d_tokens: int = 128
    d_reps: int = 5
    r_context: int = 448  # R: the shared context's tokens
    r_questions: int = 8  # R: requests per round, each the context + its own question
    r_tokens: int = 8
    r_rounds: int = 3  # R: measured rounds (after one warm-up round)
    e_levels: tuple[int, ...] = (32, 64)  # E: concurrent clients (the goal is read at 32)
    e_per_client: int = 3  # E: requests per client
    e_rounds: int = 3  # E: measured rounds per level and mode (the median counts)
    e_prompt_tokens: int = 48
    e_tokens: int = 128
    s_tokens: int = 96  # S: max_tokens of both sides (the constrained side may end sooner)
    s_rounds: int = 3  # S: measured rounds (the median counts)
    s_single_requests: int = 3  # S: requests of the 1-client loop per side and round
    s_clients: int = 8
    s_per_client: int = 2  # S: requests per client in the 8-client loop per side and round
    s_compile_reps: int = 9  # S: fresh compiles of the 2 kB schema
    k_levels: tuple[int, ...] = (1, 8, 32)  # K: clients (closed loops), each server in turn
    k_tokens: int = 128  # K: greedy tokens per request (ignore_eos)
    k_rounds: int = 3  # K: measured rounds per level and server (the median counts)
    k_single_requests: int = 4  # K: requests of the 1-client loop per round
    k_per_client: int = 2  # K: requests per client per round beyond 1 client
    m_clients: int = 16  # M: streams decoding while the long prompts arrive
    m_tokens: int = 256  # M: greedy tokens per stream (ignore_eos)
    m_long: int = 2048  # M: tokens of each long prompt
    m_every: float = 4.0  # M: seconds between two long prompts
    p_tokens: int = 256  # P: most tokens of the 1-client answers (greedy; they end where the model ends them)
    p_reps: int = 3  # P: requests per task and server at 1 client (alternating)
    p_clients: int = 32  # P: closed-loop clients of the wide run, one request each
    p_wide_tokens: int = 64  # P: most tokens of the wide run's answers
    p_wide_rounds: int = 5  # P: rounds of the wide run per server (the median of the rounds' ratios counts)
    v_levels: tuple[int, ...] = (1, 8, 32)  # V: clients (vllm bench serve --max-concurrency), each server in turn
    v_min_prompts: int = 16  # V: requests per level: max(v_min_prompts, v_prompts_per_client x clients)
    v_prompts_per_client: int = 4
    v_input: int = 256  # V: random prompt tokens at the levels
    v_output: int = 128  # V: answer tokens at the levels (ignore_eos)
    v_mixed_clients: int = 16  # V: the mixed-length load
    v_mixed_prompts: int = 64
    v_mixed_input: int = 512  # drawn from [512 x 0.1, 512 x 1.9] = 51..973 prompt tokens
    v_mixed_input_ratio: float = 0.9
    v_mixed_output: int = 128  # drawn from [128 x 0.2, 128 x 1.8] = 25..231 answer tokens
    v_mixed_output_ratio: float = 0.8
    v_warmups: int = 8  # V: warm-up requests before each run (at most one per client)
    v_client_timeout: float = 1800.0  # V: seconds one vllm bench serve may take
    v_ready_timeout: float = 900.0  # V: seconds vLLM may take to start (it compiles its model first)
    f_rounds: int = 3  # F: rounds of (bandwidth, matmul, 1-row steps, 32-row steps); the median of the rounds counts
    f_prompt_tokens: int = 64  # F: each row's prompt
    f_warmup: int = 8  # F: decode steps before the timed ones, per batch and round
    f_steps_1: int = 64  # F: timed decode steps of the 1-row batch per round (the median counts)
    f_steps_32: int = 24  # F: timed decode steps of the 32-row batch per round
    f_step_seconds: float = 15.0  # F: no more timed steps of a batch after this long (a busy machine; at least 5)
    f_bandwidth_mib: int = 1024  # F: the float32 tensor summed and copied
    f_mm_size: int = 4096  # F: torch.mm of two f_mm_size-squared matrices
    f_reps: int = 5  # F: the best of this many sums, copies and matmuls per round
    f_profile_steps: int = 16  # F: steps of each batch under torch.profiler when a goal is missed (0: none)
    # seconds after which a part stops adding repetitions to replace ones disturbed by other processes
    a_budget: float = 90.0
    t_budget: float = 40.0
    b_budget: float = 150.0
    c_budget: float = 40.0
    l_budget: float = 200.0  # L and R: a level (round) disturbed by other processes is run again while within this
    s_budget: float = 240.0  # S: per level
    k_budget: float = 120.0  # K: per level and server
    f_budget: float = 180.0  # F: rounds disturbed by other processes are replaced while within this

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run: every part once, short generations, the fewest repetitions a part's figures need, and no
        time budgets at all (a repetition disturbed by other processes is kept, not replaced: on a busy machine
        replacing them is what made a quick run long). What it costs is mostly the server starts and model loads,
        so its length depends on the machine; the run prints how long it took."""
        return cls(
            l_levels=(1, 2, 4, 8, 16),
            a_tokens=16,
            a_reps=3,
            warmup=1,
            b_tokens=16,
            b_rounds=1,
            b_single_requests=2,
            b_per_client=1,
            c_rounds=3,
            c_per_round=10,
            t_tokens=8,
            t_reps=3,
            l_tokens=8,
            l_requests=4,
            l_level_seconds=8.0,
            d_tokens=16,
            d_reps=2,
            r_context=96,
            r_questions=3,
            r_tokens=4,
            r_rounds=1,
            e_levels=(32,),
            e_per_client=1,
            e_rounds=1,
            e_tokens=32,
            s_tokens=96,
            s_rounds=1,
            s_single_requests=1,
            s_per_client=1,
            s_compile_reps=3,
            k_levels=(1, 8),
            k_tokens=16,
            k_rounds=1,
            k_single_requests=2,
            k_per_client=1,
            m_clients=4,
            m_tokens=64,
            m_long=384,
            m_every=1.0,
            p_tokens=64,
            p_reps=1,
            p_clients=4,
            p_wide_tokens=16,
            p_wide_rounds=1,
            v_min_prompts=8,
            v_prompts_per_client=1,
            v_input=64,
            v_output=32,
            v_mixed_prompts=16,
            v_mixed_output=64,
            v_warmups=2,
            v_client_timeout=600.0,
            f_rounds=1,
            f_warmup=2,
            f_steps_1=8,
            f_steps_32=3,
            f_step_seconds=5.0,
            f_bandwidth_mib=256,
            f_mm_size=2048,
            f_reps=3,
            f_profile_steps=4,
            a_budget=0.0,
            t_budget=0.0,
            b_budget=0.0,
            c_budget=0.0,
            l_budget=0.0,
            s_budget=0.0,
            k_budget=0.0,
            f_budget=0.0,
        )

    def budgets(self) -> dict[str, float]:
        """The seconds each part may spend replacing disturbed repetitions."""
        return {name: value for name, value in vars(self).items() if name.endswith("_budget")}

"""D (GPU): a 1B-class Llama-shaped model (16 layers, 2048 wide, 32 heads / 8 KV heads) in bf16: the server's
decode ms per token (``timing.decode_ms`` over the tokens after the first) divided by the bandwidth floor (weight
bytes / device-to-device copy bandwidth). Goal <= 1.3. ``--only D --device cuda`` (or ``--gpu``); ``--quick``
uses a 4-layer, 512-wide one. Not with ``--url``."""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING

from tooling.bench.client import Client
from tooling.bench.machine import cpu_model
from tooling.bench.models import LLAMA_1B, LLAMA_SMALL, ensure_model, parameter_count, prompt_ids
from tooling.bench.plan import GOALS, check_goal
from tooling.bench.report import Row, bars, met
from tooling.bench.stats import med, spread, summary

if TYPE_CHECKING:
    from tooling.bench.runner import Bench


def run(bench: Bench) -> dict:
    import torch

    plan = bench.plan
    device = bench.args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} but no CUDA GPU is visible")
    spec = LLAMA_SMALL if bench.args.quick else LLAMA_1B
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    path = ensure_model(spec, bench.cache_dir, bench.log, device=device)
    bench.record_model("gpu", spec, path)
    model, tok = bench.reference("gpu", path, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, (256 if bench.args.quick else 1024) * 2**20)
    floor_ms = weight_bytes / bandwidth * 1000
    ids = prompt_ids(tok, plan.prompt_tokens)
    server = bench.start_server(path, spec.name, device=device, dtype=dtype)
    client = Client(server.url)
    body = {"model": spec.name, "prompt": ids, "max_tokens": plan.d_tokens, "temperature": 0, "ignore_eos": True}
    try:
        for _ in range(plan.warmup):
            client.complete(body)
        decode, e2e, gen = [], [], []
        t_ids = torch.tensor([ids], device=device)
        for _ in range(plan.d_reps):
            reply = client.complete(body)
            timing = reply.timing or {}
            if "decode_ms" in timing and reply.tokens > 1:
                decode.append(timing["decode_ms"] / (reply.tokens - 1))  # the first token comes from prefill
            e2e.append(reply.e2e_s * 1000 / reply.tokens)
            bench.settle()
            with torch.inference_mode():
                _sync(device)
                start = time.perf_counter()
                model.generate(
                    t_ids,
                    attention_mask=torch.ones_like(t_ids),
                    max_new_tokens=plan.d_tokens,
                    min_new_tokens=plan.d_tokens,
                    do_sample=False,
                    pad_token_id=tok.eos_token_id,
                )
                _sync(device)
                gen.append((time.perf_counter() - start) * 1000 / plan.d_tokens)
            bench.settle()
    finally:
        client.close()
        bench.stop_server(server)
    result = {
        "device": device_name(device),
        "dtype": dtype,
        "parameters": parameter_count(model),
        "weight_bytes": weight_bytes,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "floor_ms_per_token": round(floor_ms, 3),
        "generated_tokens": plan.d_tokens,
        "server_e2e_ms_per_token": summary(e2e),
        "generate_ms_per_token": summary(gen),
    }
    if decode:
        ratio = statistics.median(decode) / floor_ms
        result.update(
            {
                "server_decode_ms_per_token": summary(decode),
                "ratio": round(ratio, 3),
                "goal": GOALS["D"][1],
                "met": check_goal("D", ratio),
            }
        )
    bench.drop_reference("gpu")
    return result


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def copy_bandwidth(device: str, nbytes: int, reps: int = 20) -> float:
    """Bytes per second moved by a device-to-device copy (each copy reads and writes ``nbytes``)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / best


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()


def rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    d = result
    rows.append(
        (
            "D",
            f"bandwidth floor ms/token ({d['device']})",
            f"{d['floor_ms_per_token']:g}",
            f"{d['weight_bytes'] / 1e9:.2f} GB at {d['copy_bandwidth_gb_s']:g} GB/s",
            "",
        )
    )
    if "ratio" in d:
        rows.append(
            (
                "D",
                "server decode ms/token",
                med(d["server_decode_ms_per_token"]),
                spread(d["server_decode_ms_per_token"]),
                "",
            )
        )
        rows.append(("D", "ratio decode / floor", f"{d['ratio']:g}", "", f"<= {d['goal']:g}: {met(d['met'])}"))
    rows.append(
        (
            "D",
            "generate() ms/token (in-process)",
            med(d["generate_ms_per_token"]),
            spread(d["generate_ms_per_token"]),
            "",
        )
    )
    return rows


def draw(ax, r: dict) -> None:
    d = r["D"]
    floor = d["floor_ms_per_token"]
    names, series = ["bandwidth floor"], [{"median": floor, "min": floor, "max": floor}]
    for label, key in (
        ("server decode", "server_decode_ms_per_token"),
        ("generate()", "generate_ms_per_token"),
    ):
        if d.get(key, {}).get("n"):
            names.append(label)
            series.append(d[key])
    bars(ax, names, series, ["grey", "tab:blue", "tab:orange"])
    ax.set_ylabel("ms per token")
    ax.set_title(f"D: {d['device']}, ratio {d.get('ratio', '-')} (goal <= {GOALS['D'][1]})", fontsize=9)


PANELS = (draw,)

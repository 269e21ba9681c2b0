"""Where a compiled CUDA decode step's time goes (1B Llama, bf16, one request): the graph replay alone against the
engine's whole step, and the profiler's top host-side entries."""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from app.bench.models import LLAMA_1B, ensure_model
from app.engine.params import SamplingParams
from app.engine.worker import Worker
from app.settings import Settings

quant = sys.argv[1] if len(sys.argv) > 1 else None
path = ensure_model(LLAMA_1B, Path(".cache/bench"), print, device="cuda")
w = Worker.from_settings(
    Settings(model=str(path), device="cuda", dtype="bfloat16", compile=True, max_batch_rows=8, quantize=quant)
)
w.load()
ids = list(range(100, 612))
params = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
for _ in range(2):
    w.complete([ids], params, 4096)
torch.cuda.synchronize()
t = time.perf_counter()
(out,), timings = w.complete([ids], params, 4096)
torch.cuda.synchronize()
wall = time.perf_counter() - t
print(f"quantize={quant}: 512-token prompt + 129 tokens: {wall * 1000:.1f} ms; timings {timings}")
# the graph replay alone, bucket 1, on the scheduler's own store (as the warm-up runs it)
runner, batch = w.runner, w.scheduler.batch
store = batch.store
zeros = torch.zeros(1, dtype=torch.long, device="cuda")
with torch.inference_mode():
    for _ in range(5):
        runner.compiled_step(zeros, zeros.clone(), store, store.capacity)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        runner.compiled_step(zeros, zeros.clone(), store, store.capacity)
    torch.cuda.synchronize()
    print(f"compiled step alone (bucket 1, view {store.capacity}): {(time.perf_counter() - t) / 50 * 1000:.3f} ms")
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(50):
        runner.compiled_step(zeros, zeros.clone(), store, store.capacity)
    ev1.record()
    torch.cuda.synchronize()
    print(f"  GPU time per step: {ev0.elapsed_time(ev1) / 50:.3f} ms")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    w.complete([ids], SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True), 4096)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))

"""Where a compiled decode step's time goes (1B Llama, bf16, one request): the compiled step replayed alone against
the engine's whole step, and the profiler's top entries.

    python3 scripts/gpu/profile_d.py [int4]                       # on the GPU (the 1B Llama shape)
    python3 scripts/gpu/profile_d.py --device cpu --model PATH    # a smoke run of this script on the CPU

The step is replayed as the warm-up runs it (``BlockBatch.warm_up``): bucket 1, one padding row on the null block,
attending over the whole capacity on CUDA (one CUDA graph per bucket) or the smallest window on the CPU."""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from app.engine.model.shapes import windows
from app.engine.core.blocks import BLOCK
from tooling.bench.models import model_or_1b
from app.engine.params import SamplingParams
from app.engine.core.worker import Worker
from app.settings import Settings

parser = argparse.ArgumentParser()
parser.add_argument("quantize", nargs="?", default=None)
parser.add_argument("--device", default="cuda")
parser.add_argument("--rows", type=int, default=1, help="prompts decoded together in the profiled request")
parser.add_argument("--model", default=None, help="a model folder (default: the bench's 1B Llama shape)")
args = parser.parse_args()
cuda = args.device.startswith("cuda")
path = model_or_1b(args.model, args.device)
dtype = "bfloat16" if cuda else "float32"
w = Worker.from_settings(
    Settings(
        model=str(path),
        device=args.device,
        dtype=dtype,
        compile=True,
        max_batch_rows=max(8, args.rows),
        quantize=args.quantize,
    )
)
w.load()


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


context = w.info.context_length  # 512 + 129 for the 1B shape; less for a smaller model's context
prompt = min(512, context // 2)
ids = list(range(100, 100 + prompt))
params = SamplingParams(max_tokens=min(129, context // 4), temperature=0.0, ignore_eos=True)
for _ in range(2):
    w.complete([ids], params, context)
sync()
t = time.perf_counter()
(out,), timings = w.complete([ids], params, context)
sync()
wall = time.perf_counter() - t
print(f"quantize={args.quantize}: {prompt}-token prompt + {params.max_tokens} tokens: {wall * 1000:.1f} ms; {timings}")
runner, batch = w.runner, w.scheduler.batch
pool = batch.pool
width = batch.capacity if batch.static else windows(batch.capacity)[0]
device = pool.keys[0].device
zeros = torch.zeros(1, dtype=torch.long, device=device)
gather = torch.zeros(1, width // BLOCK, dtype=torch.long, device=device)


def replay() -> None:
    runner.compiled_step(zeros, zeros.clone(), zeros.clone(), gather, pool.keys, pool.values)


def replay_alone() -> None:
    """The compiled step replayed from this thread: on CUDA inductor's graph trees live in the thread that
    captured them (the engine's model thread), so there this raises and the profile below is what remains."""
    with torch.inference_mode():
        for _ in range(5):
            replay()
        sync()
        t = time.perf_counter()
        for _ in range(50):
            replay()
        sync()
        print(f"compiled step alone (bucket 1, {width} positions): {(time.perf_counter() - t) / 50 * 1000:.3f} ms")
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            for _ in range(50):
                replay()
            ev1.record()
            torch.cuda.synchronize()
            print(f"  GPU time per step: {ev0.elapsed_time(ev1) / 50:.3f} ms")


try:
    replay_alone()
except AssertionError:
    print("compiled step alone: not replayable from this thread (its CUDA graphs belong to the model thread)")
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=activities) as prof:
    w.complete(
        [[i + r for i in ids] for r in range(args.rows)],
        SamplingParams(max_tokens=min(33, context // 8), temperature=0.0, ignore_eos=True),
        context,
    )
    sync()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
if cuda:
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))

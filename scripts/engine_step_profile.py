"""Where an engine step's time goes on the host: bench part E's load (the tiny 2-layer GPT-2, 32 requests at once,
48-token prompts, 128 tokens each, greedy or sampled) run in process, straight on the engine (no HTTP, no output
decoding until a request ends), with the engine thread's time split by torch.profiler-free wall clocks:

- ``forward``: ``ModelRunner.rows_step`` (the model's forward over the batch);
- ``sample``: the sampler's pass and its host transfer;
- ``step``: the whole ``EngineCore.step`` (schedule, execute, postprocess);

and prints the shares (record it with py-spy to see inside them).

    PYTHONPATH=. .venv/bin/python scripts/engine_step_profile.py [--sampled] [--clients 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sampled", action="store_true")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from app.engine.core import engine_core, step
    from app.engine.core.worker import Worker
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import load_model
    from app.engine.params import SamplingParams
    from tooling.bench.models import GPT2_TINY, ensure_model

    torch.set_num_threads(args.threads)
    path = ensure_model(GPT2_TINY, Path(".cache/bench"), print)
    worker = Worker.from_loaded(
        ("m",), load_model(LoadConfig(model=str(path))), max_batch_rows=args.clients, kv_cache_tokens=32768
    )
    clocks: dict[str, list[float]] = {"forward": [], "sample": [], "step": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clocks[name].append(time.perf_counter() - start)

        return wrapper

    worker.runner.rows_step = timed("forward", worker.runner.rows_step)
    step.sample_step = timed("sample", step.sample_step)
    engine_core.EngineCore.step = timed("step", engine_core.EngineCore.step)

    mode = {"temperature": 0.8, "top_p": 0.9, "logprobs": 5} if args.sampled else {"temperature": 0.0}
    prompt = list(range(5, 53))

    def client(i: int) -> None:
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=i, **mode)
        worker.complete([prompt], params, max_length=256)

    for _ in range(2):  # the first round warms up
        for v in clocks.values():
            v.clear()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    steps = len(clocks["step"])
    total = sum(clocks["step"])
    print(f"{args.clients} clients x {args.tokens} tokens, {'sampled' if args.sampled else 'greedy'}: {wall:.2f} s")
    print(f"steps {steps}, step median {1e3 * statistics.median(clocks['step']):.2f} ms")
    for name in ("forward", "sample"):
        print(f"  {name}: {1e3 * statistics.median(clocks[name]):.2f} ms median, {sum(clocks[name]) / total:.1%}")
    print(f"  rest of the step (host): {(total - sum(clocks['forward']) - sum(clocks['sample'])) / total:.1%}")
    print(f"  outside steps (waits, outputs): {(wall - total) / wall:.1%} of the wall clock")
    print(f"delivered tokens/s: {args.clients * args.tokens / wall:.0f}")


if __name__ == "__main__":
    main()

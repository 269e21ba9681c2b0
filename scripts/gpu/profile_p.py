"""Where a speculative step's time goes on a GPU (issue 26): one greedy request on the compiled engine, decoded
plainly and with an oracle proposer that always guesses the plain answer (every guess kept), each step's time on the
model thread and cProfile's top entries for each; then how far a bf16 position's logits move when it is computed
among 5 queries instead of alone (plain transformers forwards over a cache: the width dependence of the GEMMs).

    python3 scripts/gpu/profile_p.py [--invariant]                  # on the GPU (the bench's 1B Llama shape)
    python3 scripts/gpu/profile_p.py --device cpu --model PATH      # a smoke run of this script on the CPU"""

import argparse
import cProfile
import pstats
import time

import torch

from tooling.bench.models import model_or_1b
from app.engine.params import SamplingParams
from app.engine.core.speculative import Proposer, Speculation
from app.engine.core.worker import Worker
from app.settings import Settings

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--model", default=None, help="a model folder (default: the bench's 1B Llama shape)")
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--invariant", action="store_true", help="SAKER_BATCH_INVARIANT (fixed-order kernels)")
args = parser.parse_args()
cuda = args.device.startswith("cuda")
path = model_or_1b(args.model, args.device)
dtype = "bfloat16" if cuda else "float32"
settings = Settings(
    model=str(path),
    device=args.device,
    dtype=dtype,
    compile=True,
    max_batch_rows=32,
    prefix_cache_tokens=0,
    batch_invariant=args.invariant,
)
w = Worker.from_settings(settings)
w.load()
context = w.info.context_length
ids = [10 + (7 * i) % (min(1000, w.info.vocab_size) - 20) for i in range(min(128, context // 2))]
params = SamplingParams(max_tokens=min(args.tokens, context // 2), temperature=0.0, ignore_eos=True)
(plain,), _ = w.complete([ids], params, context)
answer = list(plain.choices[0].token_ids)


class Oracle(Proposer):
    def guess(self, state, tokens, k):
        made = len(tokens) - len(ids)
        return answer[made : made + k]


scheduler = w.scheduler
profiles: dict[str, cProfile.Profile] = {}
mode = ["plain"]
execute = scheduler._execute


def timed(plan):  # runs on the model thread: cProfile follows the thread that enables it
    prof = profiles.setdefault(mode[0], cProfile.Profile())
    prof.enable()
    try:
        return execute(plan)
    finally:
        prof.disable()


scheduler._execute = timed
speculation = Speculation(Oracle(), 4, 4)
for label in ("plain", "oracle", "plain", "oracle"):
    mode[0] = label
    scheduler.batch.speculation = speculation if label == "oracle" else None
    steps = scheduler.steps
    t = time.perf_counter()
    (out,), timings = w.complete([ids], params, context)
    wall = time.perf_counter() - t
    steps = scheduler.steps - steps
    same = list(out.choices[0].token_ids) == answer
    print(
        f"{label}: {wall * 1e3:.1f} ms for {len(answer)} tokens, {steps} steps, {wall * 1e3 / steps:.3f} ms/step, "
        f"same tokens {same}; decode_ms {timings.get('decode_ms') if isinstance(timings, dict) else timings}",
        flush=True,
    )
for label, prof in profiles.items():
    print(f"\n== {label}: model thread, by own time (both runs)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    print(f"== {label}: by cumulative time")
    pstats.Stats(prof).sort_stats("cumtime").print_stats(30)
try:
    from torch._dynamo.utils import counters

    print("dynamo counters:", {k: dict(v) for k, v in counters.items() if v})
except Exception as exc:
    print("no counters:", exc)

# the width dependence of a plain bf16 forward: a position alone vs among 5 queries, over the same cached prefix
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(args.device).eval()
if args.invariant:
    from app.engine.model.optimize import make_batch_invariant

    print("fixed-order modules in the plain model:", make_batch_invariant(model, force=not cuda))
seq = torch.tensor([ids + answer[:8]], device=args.device)
n = len(ids)
with torch.inference_mode():
    cache = DynamicCache()
    model(seq[:, :n], past_key_values=cache, use_cache=True)
    wide = model(seq[:, n : n + 5], past_key_values=cache, use_cache=True).logits[0].float()
    alone = []
    for j in range(5):
        cache = DynamicCache()
        model(seq[:, : n + j], past_key_values=cache, use_cache=True)
        alone.append(model(seq[:, n + j : n + j + 1], past_key_values=cache, use_cache=True).logits[0, 0].float())
    alone = torch.stack(alone)
    diff = (wide - alone).abs().max(dim=-1).values
    lp = torch.log_softmax(wide, -1) - torch.log_softmax(alone, -1)
    print(f"\n{dtype}: logits' max |diff| per position, 5 queries vs alone: {[round(float(d), 5) for d in diff]}")
    print(
        f"logprobs' max |diff|: {float(lp.abs().max()):.5f}; argmax equal: "
        f"{(wide.argmax(-1) == alone.argmax(-1)).tolist()}"
    )

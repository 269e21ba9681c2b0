"""Probe (not used by the server): a fixed-order float32 CPU attention that reads each query's keys and values in
place from the block pool, against the engine's float64 path (``app/engine/attention.py``: the blocks copied by
``index_select``, then float64 products), on SmolLM2's attention shape (9 query heads, 3 kv heads, head dim 64).

Each query-head's sums run over its own positions in one fixed order, whatever other queries come with it, so the
result is the same whether a position is computed alone, in a chunk of a prompt or as a decode row: path
independence by construction, without float64. Queries that share a sequence go in tiles, so that each key and
value is read once per tile. The probe checks that (alone == in tiles of 16 == in tiles of 5) and times a decode
step's rows and prompt chunks at two positions, 30 layers each (docs/performance.md, "One engine interface, one
queue, a Sequence per candidate").

    python scripts/experiments/paged_attention_probe.py      # builds the kernel with torch's cpp_extension (~20 s)
"""

import time
import types

import torch
from torch.utils.cpp_extension import load_inline

from app.engine.attention import Scratch, _read, exact_attention

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <vector>
#include <omp.h>
// q: (Q, Hq, 64); keys, values: (slots, Hkv, 64) float32, blocks of 16 slots; tables: (T, B) block ids; which: (Q,)
// each query's table row; lengths: (Q,) positions each query sees. Tiles: runs of up to TQ consecutive queries with
// the same table row; per (tile, kv head) each key and value is read once for the tile's queries x group heads.
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                     torch::Tensor which, torch::Tensor lengths, double scale, int64_t TQ) {
  const int64_t Q = q.size(0), Hq = q.size(1), D = 64, Hkv = keys.size(1), B = tables.size(1);
  const int64_t group = Hq / Hkv;
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>(); const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>(); const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* wp = which.data_ptr<int64_t>(); const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t i = 0; i < Q;) {
    int64_t j = i + 1;
    while (j < Q && j - i < TQ && wp[j] == wp[i]) ++j;
    tiles.push_back({i, j});
    i = j;
  }
  const int64_t NT = tiles.size();
  #pragma omp parallel
  {
    std::vector<float> s;
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t t = 0; t < NT; ++t) for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const int64_t a = tiles[t].first, b = tiles[t].second, m = (b - a) * group;
      int64_t nmax = 0;
      for (int64_t i = a; i < b; ++i) nmax = lp[i] > nmax ? lp[i] : nmax;
      const int64_t* table = tp + wp[a] * B;
      s.assign(m * nmax, 0.f);
      std::vector<float> mx(m, -INFINITY), sum(m, 0.f);
      for (int64_t p = 0; p < nmax; ++p) {
        const float* k = kp + ((table[p >> 4] * 16 + (p & 15)) * Hkv + kvh) * D;
        for (int64_t i = a; i < b; ++i) {
          if (p >= lp[i]) continue;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (i - a) * group + g;
            const float* qq = qp + (i * Hq + kvh * group + g) * D;
            float acc = 0.f;
            #pragma omp simd reduction(+:acc)
            for (int64_t d = 0; d < D; ++d) acc += qq[d] * k[d];
            acc *= (float)scale;
            s[r * nmax + p] = acc;
            mx[r] = acc > mx[r] ? acc : mx[r];
          }
        }
      }
      for (int64_t i = a; i < b; ++i) for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (i - a) * group + g;
        float* sr = s.data() + r * nmax;
        float acc = 0.f;
        for (int64_t p = 0; p < lp[i]; ++p) { sr[p] = std::exp(sr[p] - mx[r]); acc += sr[p]; }
        sum[r] = acc;
      }
      for (int64_t p = 0; p < nmax; ++p) {
        const float* v = vp + ((table[p >> 4] * 16 + (p & 15)) * Hkv + kvh) * D;
        for (int64_t i = a; i < b; ++i) {
          if (p >= lp[i]) continue;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (i - a) * group + g;
            const float w = s[r * nmax + p];
            float* o = op + (i * Hq + kvh * group + g) * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
          }
        }
      }
      for (int64_t i = a; i < b; ++i) for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (i - a) * group + g;
        float* o = op + (i * Hq + kvh * group + g) * D;
        const float inv = 1.f / sum[r];
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
  return out;
}
"""

HQ, HKV, DIM, BLOCKS = 9, 3, 64, 2000


def timed(fn, reps: int = 20) -> float:
    """Milliseconds for 30 layers of ``fn`` (one layer's attention)."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 30 * 1000


def main() -> None:
    started = time.perf_counter()
    kernel = load_inline(
        name="saker_paged_attention_probe",
        cpp_sources=SOURCE,
        functions=["attend"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    print(f"built in {time.perf_counter() - started:.1f} s")
    torch.manual_seed(0)
    keys32, values32 = torch.randn(BLOCKS * 16, HKV, DIM), torch.randn(BLOCKS * 16, HKV, DIM)
    keys64, values64 = keys32.double(), values32.double()
    module, scratch = types.SimpleNamespace(is_causal=True), Scratch()

    # path independence: 64 queries of one prompt at positions 1,000..1,063, alone or in tiles
    table = torch.randperm(BLOCKS)[:200].view(1, 200).long()
    queries = torch.randn(64, HQ, DIM)
    lengths = torch.arange(1000, 1064) + 1
    zero = torch.zeros(64, dtype=torch.long)
    tiles16 = kernel.attend(queries, keys32, values32, table, zero, lengths, 0.125, 16)
    tiles5 = kernel.attend(queries, keys32, values32, table, zero, lengths, 0.125, 5)
    alone = torch.stack(
        [
            kernel.attend(queries[i : i + 1], keys32, values32, table, zero[:1], lengths[i : i + 1], 0.125, 16)[0]
            for i in range(64)
        ]
    )
    print("alone == tiles of 16 == tiles of 5:", torch.equal(alone, tiles16) and torch.equal(alone, tiles5))

    def engine_rows(count: int, position: int):
        gather = torch.stack([torch.randperm(BLOCKS)[: -(-(position + 1) // 16)] for _ in range(count)]).long()
        q = torch.randn(count, HQ, 1, DIM)
        width = gather.shape[1] * 16
        mask = (torch.arange(width).view(1, -1) <= position).expand(count, width).reshape(count, 1, 1, width)

        def run():
            k, v = _read(keys64, gather, scratch, "rk"), _read(values64, gather, scratch, "rv")
            exact_attention(module, q, k, v, mask, scaling=0.125)

        return run, (q[:, :, 0].contiguous(), gather, torch.arange(count), torch.full((count,), position + 1))

    def engine_chunk(start: int, count: int = 64):
        blocks = torch.randperm(BLOCKS)[: -(-(start + count) // 16)].long()
        q = torch.randn(1, HQ, count, DIM)

        def run():
            k = _read(keys64, blocks.view(1, -1), scratch, "ck")[:, :, : start + count]
            v = _read(values64, blocks.view(1, -1), scratch, "cv")[:, :, : start + count]
            exact_attention(module, q, k, v, None, scaling=0.125)

        flat = q[0].transpose(0, 1).contiguous()
        positions = torch.arange(start, start + count)
        return run, (flat, blocks.view(1, -1), torch.zeros(count, dtype=torch.long), positions + 1)

    with torch.inference_mode():
        for name, (run, (q, tables, which, lens)) in [
            ("16 decode rows at position 400", engine_rows(16, 400)),
            ("a 64-token chunk at position 1,000", engine_chunk(1000)),
            ("a 64-token chunk at position 2,000", engine_chunk(2000)),
        ]:
            float64 = timed(run)
            fixed = timed(lambda args=(q, keys32, values32, tables, which, lens): kernel.attend(*args, 0.125, 16))
            print(f"{name}: engine's float64 path {float64:.1f} ms, fixed-order float32 kernel {fixed:.1f} ms")


if __name__ == "__main__":
    main()

"""saker's CPU kernels (``app/engine/model/kernels/``) against float64 references written here, and their point: a
query's (a row's) output is the same bits whatever else is computed with it. The attention kernel over the block
pool; the int8 linear with float32 outputs that an int4/int8 model's LM head uses."""

from __future__ import annotations

import pytest
import torch

from app.engine.model import cpu_kernels
from app.engine.model.attention import FlatStep, exact_attention
from app.engine.core.blocks import BLOCK
from references import pool_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.supports(64), reason="the CPU kernels cannot be built here")

HQ, HKV, D, BLOCKS = 6, 2, 64, 64


@pytest.fixture
def pool():
    torch.manual_seed(0)
    return torch.randn(BLOCKS * BLOCK, HKV, D), torch.randn(BLOCKS * BLOCK, HKV, D)


def test_rows_and_chunks_read_in_place_equal_float64_attention(pool):
    keys, values = pool
    tables = torch.stack([torch.randperm(BLOCKS - 1)[:12] + 1 for _ in range(4)])
    # two decode rows, then a 21-token chunk and a 3-token chunk of two prompts; one window
    which = torch.tensor([0, 1] + [2] * 21 + [3] * 3)
    hi = torch.cat([torch.tensor([5, 170]), torch.arange(100, 121) + 1, torch.arange(17, 20) + 1])
    for lo in (torch.zeros_like(hi), (hi - 40).clamp_min(0)):
        q = torch.randn(len(hi), HQ, D)
        out = cpu_kernels.call(q, keys, values, tables, which, lo, hi, 0.125)
        for i in range(len(hi)):
            expected = pool_attention(q[i], keys, values, tables[which[i]], int(lo[i]), int(hi[i]), 0.125)
            torch.testing.assert_close(out[i].double(), expected, atol=2e-6, rtol=1e-5)


def test_a_query_gets_the_same_bits_alone_in_a_tile_or_beside_other_rows(pool):
    keys, values = pool
    tables = torch.stack([torch.randperm(BLOCKS - 1)[:20] + 1 for _ in range(2)])
    n = 40
    q = torch.randn(n, HQ, D)
    hi = torch.arange(250, 250 + n) + 1
    together = cpu_kernels.call(q, keys, values, tables[:1], torch.zeros(n, dtype=torch.long), 0 * hi, hi, 0.1)
    for i in (0, 7, 15, 16, 39):
        alone = cpu_kernels.call(
            q[i : i + 1], keys, values, tables[:1], torch.zeros(1).long(), 0 * hi[:1], hi[i : i + 1], 0.1
        )
        assert torch.equal(alone[0], together[i]), i
    # beside a decode row of another sequence, in front of it
    mixed = cpu_kernels.call(
        torch.cat([torch.randn(1, HQ, D), q[5:9]]),
        keys,
        values,
        tables,
        torch.tensor([1, 0, 0, 0, 0]),
        torch.zeros(5, dtype=torch.long),
        torch.cat([torch.tensor([77]), hi[5:9]]),
        0.1,
    )
    assert torch.equal(mixed[1:], together[5:9])


def test_what_a_query_may_not_see_changes_nothing_and_no_position_gives_zeros(pool):
    keys, values = pool
    table = (torch.randperm(BLOCKS - 1)[:4] + 1).view(1, -1)
    q = torch.randn(3, HQ, D)
    lo, hi = torch.tensor([3, 5, 9]), torch.tensor([19, 19, 9])
    args = (table, torch.zeros(3, dtype=torch.long), lo, hi, 0.125)
    clean = cpu_kernels.call(q, keys, values, *args)
    dirty_k, dirty_v = keys.clone(), values.clone()
    slots = (table.view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)
    for x in (dirty_k, dirty_v):
        x[slots[19:]] = float("nan")  # the unwritten rest of the last block
        x[slots[:3]] = float("inf")  # the positions before the queries' windows
    torch.testing.assert_close(cpu_kernels.call(q, dirty_k, dirty_v, *args)[:2, :], clean[:2])
    assert torch.equal(clean[2], torch.zeros(HQ, D))


def test_the_flat_steps_spans_name_each_tokens_table_and_positions():
    gather = torch.tensor([[3, 4, 0], [5, 0, 0]])
    chunks = ((torch.tensor([7, 8, 9, 10]), 40, 3), (torch.tensor([11]), 0, 2))
    flat = FlatStep([], [], torch.zeros(7, dtype=torch.long), 2, gather, None, torch.tensor([20, 2]), chunks)
    tables, which, lo, hi = flat.spans()
    assert tables.tolist() == [[3, 4, 0, 0], [5, 0, 0, 0], [7, 8, 9, 10], [11, 0, 0, 0]]
    assert which.tolist() == [0, 1, 2, 2, 2, 3, 3]
    assert hi.tolist() == [21, 3, 41, 42, 43, 1, 2] and lo.tolist() == [0] * 7
    assert flat.spans(8)[2].tolist() == [13, 0, 33, 34, 35, 0, 0]


def test_a_left_padded_plain_forward_equals_each_row_alone():
    """generate()'s batches pad on the left: a padded row's queries give the bits of the same row unpadded."""
    torch.manual_seed(3)
    module = type("M", (), {"is_causal": True})()
    q, k, v = torch.randn(2, HQ, 12, D), torch.randn(2, HKV, 12, D), torch.randn(2, HKV, 12, D)
    pad = 5
    mask = torch.ones(2, 1, 12, 12).tril().bool()
    mask[1, :, :, :pad] = False
    out, _ = exact_attention(module, q, k, v, mask)
    alone, _ = exact_attention(module, q[1:, :, pad:], k[1:, :, pad:], v[1:, :, pad:], None)
    assert torch.equal(out[1, pad:], alone[0])
    assert torch.equal(out[1, :pad], torch.zeros(pad, HQ, D))  # queries that see no key


def test_a_compiled_function_keeps_the_kernel_as_one_op(pool):
    keys, values = pool
    table = (torch.randperm(BLOCKS - 1)[:4] + 1).view(1, -1)
    q = torch.randn(4, HQ, D)
    positions = torch.tensor([3, 30, 31, 50])

    def step(q, positions):
        hi = positions + 1
        return cpu_kernels.call(q, keys, values, table.expand(4, -1), torch.arange(4), 0 * hi, hi, 0.125)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, positions), step(q, positions))


@pytest.mark.parametrize("k", [576, 13])
def test_the_int8_linear_is_the_float64_product_and_each_row_its_own(k):
    torch.manual_seed(k)
    weight = torch.randint(-127, 128, (300, k), dtype=torch.int8)
    scales = torch.rand(300).to(torch.bfloat16).float()
    x = torch.randn(17, k)
    out = cpu_kernels.int8_linear(x, weight, scales)
    expected = x.double() @ (weight.double() * scales.double()[:, None]).T
    # float32 sums of k products: within a few float32 ulps of the largest output
    torch.testing.assert_close(out.double(), expected, atol=4e-6 * float(expected.abs().max()), rtol=0)
    for rows in (1, 3, 8, 9):
        assert torch.equal(cpu_kernels.int8_linear(x[:rows], weight, scales), out[:rows]), rows
    assert torch.equal(cpu_kernels.int8_linear(x[5:6], weight, scales), out[5:6])


@pytest.mark.parametrize("n, k", [(300, 576), (257, 13), (49, 64)])
def test_the_int8_linears_avx512_path_gives_the_avx2_paths_bits(n, k):
    """Where the CPU has AVX-512 the int8 linear (the LM head) holds two outputs' lanes in one vector
    (``rows_wide``): every output must be the AVX2 path's bits at every width, an odd last output and a tail of k
    included."""
    ext = cpu_kernels.kernel()
    if not ext.wide_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 path runs here")
    torch.manual_seed(n + k)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n)
    x = torch.randn(19, k)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 19):
        wide = ext.int8_linear(x[:rows], weight, scales, True)
        assert torch.equal(wide, ext.int8_linear(x[:rows], weight, scales, False)), rows


def int16_groups(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the int4 kernel sees it, by plain tensor arithmetic: each row quantized per group of 32 to int16
    (``d = max |x| / 32767``, codes ``round(x * 32767 / max |x|)``, half to even), returned de-quantized in
    float64."""
    m, k = x.shape
    groups = x.view(m, k // 32, 32)
    top = groups.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > 0, 32767.0 / top, torch.zeros_like(top))
    codes = torch.round(groups * inv).clamp(-32767, 32767)
    return (codes.double() * (top / 32767.0).double()).view(m, k)


@pytest.mark.parametrize("n, k", [(300 - 12, 576), (16, 32), (64, 1536)])
def test_the_int4_linear_is_its_int16_inputs_times_its_codes_and_each_row_its_own(n, k):
    """``cpu_kernels.int4_linear`` against float64 arithmetic on what it computes with: the inputs quantized to
    int16 per group (``int16_groups``) times the weights ``q * scale + min`` de-quantized; the integer products are
    exact, so only the float32 sums of the groups differ.
    A row's outputs are the same bits alone and among 1..17 rows."""
    from app.engine.model.quantize import GROUP, int4_codes, pack_int4_cpu

    torch.manual_seed(k)
    weight = torch.randn(n, k)
    codes, scales, zeros = int4_codes(weight)
    mins = zeros - 8 * scales
    x = torch.randn(17, k) * torch.rand(1, k) * 4  # inputs of uneven sizes, as hidden states are
    x[3, :32] = 0.0  # a group of zeros (d = 0)
    packed = pack_int4_cpu(codes, scales, mins)
    out = cpu_kernels.int4_linear(x, *packed)
    weights = codes.double().view(n, k // GROUP, GROUP) * scales.double()[..., None] + mins.double()[..., None]
    expected = int16_groups(x) @ weights.view(n, k).T
    torch.testing.assert_close(out.double(), expected, atol=4e-6 * float(expected.abs().max()), rtol=0)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        assert torch.equal(cpu_kernels.int4_linear(x[:rows], *packed), out[:rows]), rows
    assert torch.equal(cpu_kernels.int4_linear(x[5:6], *packed), out[5:6])
    # the kernel's own codes are the reference's: a group's largest input is exactly +-127 of them
    assert (
        int16_groups(x).view(17, k // 32, 32).abs().amax(-1) - x.view(17, k // 32, 32).abs().amax(-1)
    ).abs().max() < 1e-6


@pytest.mark.parametrize("n, k", [(8 * 37, 576), (24, 64), (1536, 576)])
def test_the_int4_linears_avx512_path_gives_the_avx2_paths_bits(n, k):
    """Where the CPU has AVX-512 VNNI the int4 linear runs 16 outputs per vector with one instruction for the pair
    products (``rows_wide``): every output must be the AVX2 path's bits, at every width, an odd last tile included
    (37 tiles), so that a machine's instruction set never changes an answer. Inputs at the int16 codes' extremes
    and codes of 15 push the integer sums to their largest."""
    from app.engine.model.quantize import int4_codes, pack_int4_cpu

    ext = cpu_kernels.kernel()
    if not ext.wide_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 path runs here")
    torch.manual_seed(n + k)
    codes, scales, zeros = int4_codes(torch.randn(n, k))
    codes[: n // 2, :32] = 15
    packed = pack_int4_cpu(codes, scales, zeros - 8 * scales)
    x = torch.randn(19, k) * torch.rand(1, k) * 4
    x[2, :32] = 1.0  # every code of a group at 32767
    x[4, :32] = -1.0
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 19):
        wide = ext.int4_linear(x[:rows], *packed, True)
        assert torch.equal(wide, ext.int4_linear(x[:rows], *packed, False)), rows
    assert cpu_kernels.wide() == (torch.backends.cpu.get_cpu_capability() == "AVX512")


def test_products_of_one_input_in_one_call_are_each_products_bits_alone():
    """``int4_linears`` (a layer's q, k and v, its gate and up, in ``kernels/decoder_layers.cpp``): one quantization
    of x and one parallel region for several products; each output must be that product's own ``int4_linear`` bits,
    at every width and on each path the CPU has, with products whose tiles do not fill an item of 32 outputs."""
    from app.engine.model.quantize import int4_codes, pack_int4_cpu

    ext = cpu_kernels.kernel()
    torch.manual_seed(7)
    k = 576
    products = []
    for n in (8 * 37, 64, 1536, 8):
        codes, scales, zeros = int4_codes(torch.randn(n, k))
        products.append(pack_int4_cpu(codes, scales, zeros - 8 * scales))
    specs = [t for packed in products for t in packed]
    x = torch.randn(17, k) * torch.rand(1, k) * 4
    for wide in (False, True) if ext.wide_supported() else (False,):
        for rows in (1, 2, 3, 8, 9, 17):
            together = ext.int4_linears(x[:rows], specs, wide)
            assert len(together) == len(products)
            for packed, out in zip(products, together):
                assert torch.equal(out, ext.int4_linear(x[:rows], *packed, wide)), (wide, rows)
    with pytest.raises(RuntimeError, match="per product"):
        ext.int4_linears(x, specs[:4], False)


def test_the_int4_linear_refuses_what_it_cannot_compute():
    """Inputs not in whole groups of 32, outputs not in tiles of 8 and other dtypes are errors, not wrong numbers."""
    from app.engine.model.quantize import pack_int4_cpu

    codes = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    packed, ones, _ = pack_int4_cpu(codes, torch.ones(16, 2), torch.ones(16, 2))
    with pytest.raises(RuntimeError, match="groups of 32"):
        cpu_kernels.int4_linear(torch.randn(2, 48), packed[:, :24], ones, ones)
    with pytest.raises(RuntimeError, match="float32 x"):
        cpu_kernels.int4_linear(torch.randn(2, 64).double(), packed, ones, ones)
    with pytest.raises(RuntimeError, match="tiles of 8"):
        cpu_kernels.int4_linear(torch.randn(2, 64), packed[:12], ones[:12], ones[:12])
    assert cpu_kernels.int4_linear(torch.randn(0, 64), packed, ones, ones).shape == (0, 16)
    if not cpu_kernels.kernel().wide_supported():
        with pytest.raises(RuntimeError, match="AVX-512"):
            cpu_kernels.kernel().int4_linear(torch.randn(2, 64), packed, ones, ones, True)


def test_an_int8_lm_head_gives_float32_logits(llama_dir):
    """An int8 head (the int4 mode's too, where its shape allows): its logits are the product with its de-quantized
    weights in float32, not rounded to bfloat16 (whose grid made two tokens' logprobs tie exactly)."""
    from transformers import AutoModelForCausalLM

    from app.engine.model.quantize import Int8Linear, quantize_model

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    quantize_model(model, "int8")
    head = model.get_output_embeddings()
    assert isinstance(head, Int8Linear) and head.float_logits
    hidden = torch.randn(3, head.in_features)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), hidden.double() @ head.dequantized().double().T, atol=1e-5, rtol=1e-6)
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())


def peaked_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Logits shaped like a language model's: a spread of small ones and one token far above them (its probability
    from about 0.6 to 1), the case where a float32 sum in few lanes loses the small terms."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 2
    top = torch.randint(0, vocab, (rows,), generator=generator)
    logits[torch.arange(rows), top] += torch.linspace(12, 25, rows)
    return logits


def assert_exact_to_float32(lp: torch.Tensor, logits: torch.Tensor) -> None:
    """``lp`` is the float64 log-softmax of ``logits`` rounded to float32, to within 5e-7 (the normaliser's float32
    exponentials: about an ulp each, 1e-7 to 2e-7 in it)."""
    exact = torch.log_softmax(logits.double(), dim=-1)
    half_ulp = (torch.nextafter(lp, torch.tensor(float("inf"))) - lp).double() / 2
    finite = exact.isfinite()
    assert torch.equal(lp.isfinite(), finite) and torch.equal(lp[~finite].double(), exact[~finite])
    excess = ((lp.double() - exact).abs() - half_ulp)[finite]
    assert excess.max().item() <= 5e-7, f"{(lp.double() - exact)[finite].abs().max().item():.3g} from the exact value"


@pytest.mark.parametrize("vocab", [49152, 1003, 8])
def test_the_log_softmax_is_exact_to_float32_rounding_and_each_row_its_own(vocab):
    """The raw logprobs' log-softmax: the float64 result rounded to float32 (PyTorch's float32 one is 3.7e-5 off on
    the embedded model's logits on an AVX2 CPU: its lanes drop the small terms), a vocabulary in whole groups of 8
    or not, -inf logits (masked tokens) exactly -inf; each row the same bits alone or among others."""
    logits = peaked_logits(40, vocab, seed=vocab)
    logits[3, ::3] = float("-inf")
    out = cpu_kernels.log_softmax(logits)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    assert_exact_to_float32(out, logits)
    assert torch.equal(out[3, ::3], torch.full_like(out[3, ::3], float("-inf")))
    for rows in (1, 2, 7, 8, 33):
        assert torch.equal(cpu_kernels.log_softmax(logits[:rows]), out[:rows]), rows
    assert torch.equal(cpu_kernels.log_softmax(logits[17:18]), out[17:18])
    assert torch.equal(cpu_kernels.log_softmax(logits[5:].t().contiguous().t()), out[5:])  # strided input: copied


def test_a_row_with_no_finite_maximum_is_nan_as_pytorchs_is():
    bad = torch.tensor([[float("-inf")] * 9, [0.0] * 4 + [float("nan")] + [0.0] * 4, [float("inf")] + [1.0] * 8])
    assert cpu_kernels.log_softmax(bad).isnan().all()
    assert torch.log_softmax(bad, -1).isnan().all()
    assert cpu_kernels.log_softmax(torch.empty(0, 5)).shape == (0, 5)


def test_a_baton_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's loader waits while its ``lock`` file exists; a process killed mid-build leaves it behind. The next
    load removes it under saker's own lock (released by the kernel when its holder dies) instead of waiting
    forever (seen: every server start hung on one)."""
    import threading
    from pathlib import Path

    from app.engine.model import cpu_kernels

    built = cpu_kernels.kernel()
    if built is None:
        pytest.skip("the CPU kernels are not built here")
    baton = Path(built.__file__).parent / "lock"
    baton.touch()
    out: list = []
    loading = threading.Thread(target=lambda: out.append(cpu_kernels._build()), daemon=True)
    loading.start()
    loading.join(timeout=300)  # a generous deadline: the build is cached, this load takes well under a second
    assert out and out[0] is not None and not baton.exists()


def test_every_kernel_that_computes_runs_without_the_interpreter_lock():
    """Each binding that takes tensors carries ``nogil`` (pybind11's call_guard releasing the GIL), and so does the
    decoder layers' one call: while the model thread is in a kernel, the request threads' Python (HTTP, the output
    side) runs on the other cores instead of waiting for the step's arithmetic to end."""
    import re

    kernels = cpu_kernels.SOURCES[0].parent
    bindings = (kernels / "bindings.cpp").read_text()
    defs = dict(re.findall(r'm\.def\("(\w+)",(.*?)\);\n', bindings, flags=re.S))
    queries = {"attention_supports", "wide_supported"}  # answer a question, compute nothing
    assert set(defs) >= queries | {"paged_attention", "int4_linears", "sample_tokens", "log_softmax"}
    for name, rest in defs.items():
        assert (name in queries) != rest.rstrip().endswith("nogil"), name
    assert "call_guard<pybind11::gil_scoped_release>" in (kernels / "decoder_layers.cpp").read_text()

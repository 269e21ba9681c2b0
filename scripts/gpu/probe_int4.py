"""Which shapes CUDA's int4 kernel computes right: every (inner K tiles, outputs, inputs, rows) against the codes
de-quantized in float (bfloat16 scales and zeros), then CUDA's int8 kernel on odd shapes. Prints the failures."""

import torch

from app.engine.model.quantize import GROUP, int4_codes

OUTPUTS = (8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 576, 1536, 49152)
INPUTS = (32, 64, 96, 128, 192, 256, 512, 576, 1536)
ROWS = (1, 7, 16, 17, 64, 200)


def first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0][:80]


def int4_failures() -> list[tuple]:
    bad = []
    for tiles in (2, 4, 8):
        for n in OUTPUTS:
            for k in INPUTS:
                if k % (16 * tiles) or k % GROUP:
                    continue
                codes, scales, zeros = int4_codes(torch.randn(n, k))
                pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).cuda()
                try:
                    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
                except RuntimeError as exc:
                    bad.append((tiles, n, k, "pack", first_line(exc)))
                    continue
                scale_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().bfloat16().cuda()
                groups = codes.view(n, k // GROUP, GROUP).float()
                weights = (groups - 8) * scales.bfloat16().float()[..., None] + zeros.bfloat16().float()[..., None]
                weights = weights.view(n, k)
                for m in ROWS:
                    x = torch.randn(m, k).bfloat16()
                    want = x.float() @ weights.t()
                    try:
                        got = torch.ops.aten._weight_int4pack_mm(x.cuda(), packed, GROUP, scale_zeros).float().cpu()
                    except RuntimeError as exc:
                        bad.append((tiles, n, k, m, "mm", first_line(exc)))
                        continue
                    err = ((got - want).abs() / (want.abs().max() + 1e-6)).max().item()
                    if err > 2e-2:
                        bad.append((tiles, n, k, m, round(err, 3)))
    return bad


def int8_errors() -> None:
    for n, k, m in ((96, 64, 5), (100, 70, 3), (49152, 576, 8), (7, 9, 1)):
        w = torch.randn(n, k)
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        x = torch.randn(m, k).bfloat16()
        try:
            got = torch.ops.aten._weight_int8pack_mm(x.cuda(), q.to(torch.int8).cuda(), scale.bfloat16().cuda())
        except RuntimeError as exc:
            print("int8", n, k, m, "error", first_line(exc))
            continue
        want = x.float() @ (q * scale.bfloat16().float()[:, None]).t()
        print("int8", n, k, m, "relative error", ((got.float().cpu() - want).abs().max() / want.abs().max()).item())


if __name__ == "__main__":
    torch.manual_seed(0)
    failures = int4_failures()
    print("int4 failures:", len(failures))
    for failure in failures[:80]:
        print(failure)
    int8_errors()

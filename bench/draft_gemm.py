"""The draft step's matrix products alone, bf16 against fp8, on one GPU: what an fp8 drafter would save.

    python bench/draft_gemm.py [--rows 1,15,16,120,128,480,512]

For each row count M (a DFlash block is 16 rows a request: 15 draft rows through the head), ``F.linear`` of an
``[M, K]`` bf16 input by the 8B-shaped weights a draft layer and the head hold (gate/up 14336 x 4096, down
4096 x 14336, q+k+v 6144 x 4096, the 128k-vocabulary head 128256 x 4096), then ``torch._scaled_mm`` with fp8
(e4m3) operands and unit scales at the same shapes (M padded to a multiple of 16, as it requires). Printed, one
JSON object a line: milliseconds (mean of 50 after 5 warm-up calls) and the weight bytes read per second.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = {"gate_up": (14336, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "head": (128256, 4096)}


def timed(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,15,16,120,128,480,512")
    a = ap.parse_args()
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}), flush=True)
    torch.manual_seed(0)
    one = torch.ones((), device="cuda")
    for m in (int(r) for r in a.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            bf16 = timed(lambda: F.linear(x, w))
            padded = max(16, -(-m // 16) * 16)
            x8 = torch.zeros(padded, k, device="cuda").to(torch.float8_e4m3fn)
            w8 = w.to(torch.float8_e4m3fn)
            fp8 = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            print(json.dumps({"rows": m, "weight": name, "bf16_ms": round(bf16, 4),
                              "bf16_GBps": round(n * k * 2 / bf16 / 1e6), "fp8_ms": round(fp8, 4),
                              "fp8_GBps": round(n * k / fp8 / 1e6)}), flush=True)


if __name__ == "__main__":
    main()

"""The GEMV kernels' inner loops as an H100/H200 runs them, read without a GPU: each launch compiled for sm_90
(``tests/kernels/sm90.py``'s driver: Triton's compiler and the ptxas its wheel ships), disassembled with the
``cuobjdump`` it ships, and its longest loop counted. Prints per kernel: registers, spills (local memory), the loop's
warp-instructions, and those per 16 bytes of weights streamed, against what an SM can issue while HBM delivers
about 16 bytes per SM per cycle (4 warp-instructions per cycle).

A static count, not a timing: it says whether a kernel can keep up with the memory, not how fast it runs.

    python bench/sass.py                 # Llama-3.1-8B's fused gate_up [28672 x 4096], the configured tiles
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("bench/sass.py compiles the kernels: run it without TRITON_INTERPRET=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402

from ppsplit.triton_kernels.fp8 import gemv_config, launch_fp8_linear, launch_fp8_linear_silu_mul  # noqa: E402
from ppsplit.triton_kernels.gemv import launch_gemv, pick_config  # noqa: E402
from tests.kernels.sm90 import compile_only, programmatic  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
BYTES_PER_SM_CYCLE = 16   # an H200's 4.2 TB/s over 132 SMs at 1.98 GHz
ISSUE_PER_SM_CYCLE = 4    # warp-instructions


def programmatic_launches(launch, *args):
    """``launch(*args)`` under programmatic dependent launch (as on an sm_90 GPU with it switched on)."""
    with programmatic():
        return launch(*args)


def compiled(launch):
    kernels: list = []
    with compile_only(kernels), torch.no_grad():
        launch()
    return kernels[0]


def cuobjdump(kernel, *flags) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([CUOBJDUMP, *flags, f.name], capture_output=True, text=True, check=True).stdout


def longest_loop(sass: str) -> list[str]:
    """The instructions between the target of a backward branch and the branch, the longest such range."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?)\s*;", sass)]
    best: list[str] = []
    for addr, text in code:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in code if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def attention_rows() -> dict:
    """The decode attention kernels' loops, per 16 bytes of keys and values read: the paged kernel under its plan for
    32 sequences of 128..4096 positions (``bench/ragged.py``'s step), and the lockstep split-KV kernel. A loop step
    reads ``block_n`` keys and values of one KV head (bf16, head dim 128), split over the program's warps."""
    from ppsplit.triton_kernels.attention import launch_cache_attention
    from ppsplit.triton_kernels.paged import attention_plan
    from tests.kernels.sm90 import paged_attention_launch

    lengths = [128 + round(i * (4096 - 128) / 31) for i in range(32)]
    paged = paged_attention_launch(lengths, [1] * 32)
    plan = attention_plan(32, 32, 8, 32, 4112, 16, torch.device("cpu"))
    kc, vc = (torch.randn(32, 8, 2120, 128, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(32, 1, 32, 128, dtype=torch.bfloat16).transpose(1, 2)
    per_step = lambda block_n, warps: block_n * 128 * 2 * 2 / warps  # noqa: E731  (keys and values)
    return {
        f"paged decode, plan (block_n {plan['block_n']}, {plan['warps']} warps, {plan['stages']} stages)":
            (paged, per_step(plan["block_n"], plan["warps"])),
        "paged decode, three key loops": (lambda: paged(phases=True), per_step(plan["block_n"], plan["warps"])),
        "lockstep split-KV decode (block_n 64, 4 warps)": (
            lambda: launch_cache_attention(q, kc, vc, torch.tensor([2112]), 128 ** -0.5), per_step(64, 4)),
    }


def expert_rows() -> dict:
    """The MoE expert kernels' loops, per 16 bytes of stored weights: FP8 experts of DeepSeek-V3's gate_up
    ([4096, 7168], 128-blocks) and gpt-oss-120b's MXFP4 gate_up ([5760, 2880]: half a byte a value, a scale byte
    per 32), 8 rows an expert (a decode step's tile). A loop step streams ``BLOCK_N x BLOCK_K`` weights."""
    from ppsplit.triton_kernels.fp8 import launch_fp8_grouped_mm
    from ppsplit.triton_kernels.mxfp4 import launch_mxfp4_grouped_mm

    ends = torch.arange(8, 65, 8, dtype=torch.int32)
    x8, w8, s8 = (torch.randn(64, 7168, dtype=torch.bfloat16), torch.zeros(8, 4096, 7168, dtype=torch.float8_e4m3fn),
                  torch.ones(8, 32, 56))
    x4 = torch.randn(64, 2880, dtype=torch.bfloat16)
    b4, s4 = torch.zeros(8, 5760, 90, 16, dtype=torch.uint8), torch.zeros(8, 5760, 90, dtype=torch.uint8)
    return {
        "FP8 grouped experts (16, 64, 4, 3)": (lambda: launch_fp8_grouped_mm(x8, w8, s8, ends, 128, 128),
                                              64 * 128 / 4),
        **{f"MXFP4 grouped experts {cfg}{'' if mx else ', own decode'}": (
            lambda cfg=cfg, mx=mx: launch_mxfp4_grouped_mm(x4, b4, s4, ends, config=cfg, dot_scaled=mx),
            cfg[1] * (cfg[2] // 2 + cfg[2] // 32) / cfg[3])
           for cfg, mx in (((16, 64, 64, 4, 2), False), ((16, 64, 64, 4, 2), True), ((16, 64, 128, 4, 2), True),
                           ((16, 128, 128, 4, 2), True), ((16, 128, 256, 8, 2), True))},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args()
    n, k = args.n, args.k
    x = torch.randn(1, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w8 = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    s8 = torch.ones(-(-n // 128), -(-k // 128))
    x2 = torch.randn(2, k, dtype=torch.bfloat16)  # two rows: the FP8 GEMM (tl.dot)
    bf16, fp8 = pick_config(n, k), gemv_config(n, k)
    rows = {  # name: (launch, weight bytes one warp streams per loop step)
        f"bf16 GEMV {bf16}": (lambda: launch_gemv(x, w, config=bf16), bf16[0] * bf16[1] * 2 / bf16[2]),
        f"bf16 GEMV + silu_mul {bf16}": (lambda: launch_gemv(x, w, config=bf16, glu=(0, n // 2, n // 2)),
                                         bf16[0] * bf16[1] * 2 / bf16[2]),
        f"FP8 GEMV {fp8}": (lambda: launch_fp8_linear(x, w8, s8, None, 128, 128), fp8[0] * fp8[1] / fp8[2]),
        "FP8 GEMV (2, 2048, 4, 2)": (lambda: launch_fp8_linear(x, w8, s8, None, 128, 128, config=(2, 2048, 4, 2)),
                                     2 * 2048 / 4),
        f"FP8 GEMV + silu_mul {fp8}": (
            lambda: launch_fp8_linear_silu_mul(x, w8, s8, None, 128, 128, 0, n // 2, n // 2), fp8[0] * fp8[1] / fp8[2]),
        f"FP8 GEMV {fp8}, PDL": (lambda: programmatic_launches(launch_fp8_linear, x, w8, s8, None, 128, 128),
                                 fp8[0] * fp8[1] / fp8[2]),
        "FP8 GEMM at 2 rows (64, 128, 4, 3, 1)": (
            lambda: launch_fp8_linear(x2, w8, s8, None, 128, 128, config=(64, 128, 4, 3, 1)), 64 * 128 / 4),
    }
    rows.update(attention_rows())
    rows.update(expert_rows())
    print(f"[{n} x {k}] weights, compiled for sm_90 (triton {triton.__version__}); attention: Llama-3.1-8B's heads")
    print(f"{'kernel, tiles':<40} {'regs':>4} {'local':>5} {'loop':>5} {'bytes':>6} {'per 16 B':>8} {'of issue':>8}")
    for name, (launch, step_bytes) in rows.items():
        kernel = compiled(launch)
        usage = cuobjdump(kernel, "--dump-resource-usage")
        regs, local = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "LOCAL"))
        loop = longest_loop(cuobjdump(kernel, "-sass"))
        per16 = len(loop) / step_bytes * 16
        share = per16 * BYTES_PER_SM_CYCLE / 16 / ISSUE_PER_SM_CYCLE
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
        print(f"{name:<40} {regs:>4} {local:>5} {len(loop):>5} {step_bytes:>6.0f} {per16:>8.2f} {share:>8.0%}"
              f"   {', '.join(f'{op} {c}' for op, c in ops.most_common(6))}")


if __name__ == "__main__":
    main()

"""Compile the Triton kernels of the GPU's hot paths for an H100/H200 (sm_90) on a machine without a GPU, in the
GPU's dtype (bf16, which Triton's interpreter cannot run), through the same launch functions the ops call.

Triton compiles to a cubin with the ptxas its wheel ships; only the launch needs a device. So this module makes
Triton's active driver one that targets sm_90 and turns every launch into a warm-up (compile, no launch). What it
catches that the interpreter cannot: code the compiler rejects (types, layouts, a constexpr branch the interpreter
never took), and tiles that need more shared memory than one program may have (227 KiB on an H100/H200).

Run by ``tests/kernels/test_sm90_compile.py`` in a process of its own (the test session runs Triton's interpreter,
chosen at import). Prints one line per launch: ``ok <name> <kernels> <shared bytes>`` or ``FAIL <name> <error>``.

    python -m tests.kernels.sm90
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

SHARED_MEMORY = 232448  # bytes one program may opt into on an H100 / H200 (227 KiB)
BF16 = torch.bfloat16


@contextlib.contextmanager
def compile_only(compiled: list):
    """Launches compile for sm_90 and return without running; each compiled kernel is appended to ``compiled``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    run = JITFunction.run

    def warm_up(self, *args, grid, warmup=False, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    saved = driver._active
    driver.set_active(Sm90())
    JITFunction.run = warm_up
    try:
        yield
    finally:
        JITFunction.run = run
        driver._active = saved


def ragged_step(lengths, counts, block):
    """``(step, layout)``: a ragged step built as the stages build it (``RaggedStep``, int64 metadata), sequence
    ``s`` at ``lengths[s]`` with ``counts[s]`` new tokens, blocks in order."""
    from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment

    need = [-(-(n + c) // block) for n, c in zip(lengths, counts)]
    layout = CacheLayout(slots=len(lengths), blocks_per_seq=max(need), block_size=block, num_blocks=sum(need))
    firsts = [sum(need[:s]) for s in range(len(need))]
    tables = {s: list(range(first, first + count)) for s, (first, count) in enumerate(zip(firsts, need))}
    return RaggedStep.build([Segment(s, n, c) for s, (n, c) in enumerate(zip(lengths, counts))], tables, layout), layout


def paged_attention_launch(lengths, counts, hq=32, hkv=8, d=128, block=16):
    """The paged attention over ``ragged_step(lengths, counts, block)``."""
    from ppsplit.triton_kernels.paged import launch_paged_attention

    step, layout = ragged_step(lengths, counts, block)
    q = torch.randn(1, step.num_tokens, hq, d, dtype=BF16).transpose(1, 2)
    keys, values = (torch.randn(layout.num_blocks, block, hkv, d, dtype=BF16) for _ in range(2))
    return lambda **over: launch_paged_attention(q, keys, values, step.positions, step.seq, step.block_table,
                                                 step.seq_start, step.seq_count, d ** -0.5, config=over or None)


def latent_fp8_launch(heads=128, r=512, dr=64, dn=128, dv=128, block=64):
    """DeepSeek-V3's MLA decode over paged latents with its FP8 ``kv_b_proj`` (128-blocks) read as stored: ``W_uk``
    transposed and ``W_uv`` through the grouped FP8 kernel, 4 sequences of one token."""
    from ppsplit.triton_kernels.paged import latent_fp8_views, launch_paged_latent_attention

    step, layout = ragged_step([100 + 30 * s for s in range(4)], [1] * 4, block)
    q = torch.randn(1, step.num_tokens, heads, dn + dr, dtype=BF16).transpose(1, 2)
    latents = torch.randn(layout.num_blocks, block, 1, r, dtype=BF16)
    ropes = torch.randn(layout.num_blocks, block, 1, dr, dtype=BF16)
    weight = torch.zeros(heads * (dn + dv), r, dtype=torch.float8_e4m3fn)
    views = latent_fp8_views(weight, torch.ones(heads * (dn + dv) // 128, r // 128), 128, 128, heads, dn)
    return lambda: launch_paged_latent_attention(q, latents, ropes, weight, dn, step.positions, step.seq,
                                                 step.block_table, step.seq_start, step.seq_count, 0.1, fp8=views)


def launches() -> dict:
    """``{name: function}``: one launch each, at Llama-3.1-8B's sizes where they set the tiles."""
    from ppsplit.triton_kernels.attention import launch_cache_attention
    from ppsplit.triton_kernels.fp8 import launch_fp8_grouped_mm, launch_fp8_linear, launch_fp8_linear_silu_mul
    from ppsplit.triton_kernels.fused_norm import launch_tap_kernel
    from ppsplit.triton_kernels.gemv import launch_gemv, pick_config
    from ppsplit.triton_kernels.mxfp4 import launch_mxfp4_grouped_mm
    from ppsplit.triton_kernels.paged import launch_paged_write
    from ppsplit.triton_kernels import prefetch
    from ppsplit.triton_kernels.pointwise import launch_rope, launch_rope_write, launch_silu_mul
    from ppsplit.triton_kernels.qkv import launch_linear_rope_write

    hq, hkv, d, n = 32, 8, 128, 5
    fused = torch.randn(1, n, (hq + 2 * hkv) * d, dtype=BF16)
    q, k, v = (fused[..., lo * d:(lo + h) * d].reshape(1, n, h, d).transpose(1, 2)
               for lo, h in ((0, hq), (hq, hkv), (hq + hkv, hkv)))
    cos, sin = (torch.randn(1, 1, n, d, dtype=BF16) for _ in range(2))
    pools = [torch.zeros(4, 16, hkv, d, dtype=BF16) for _ in range(2)]
    slots = torch.arange(n, dtype=torch.int32)
    token = (cos[:, :, :1], sin[:, :, :1], *pools, slots[:1], hq * d, hkv * d, d)  # a decode token's rotation
    gate_up = torch.randn(1, 1, 2 * 14336, dtype=BF16)
    x1, x32 = torch.randn(1, 4096, dtype=BF16), torch.randn(32, 4096, dtype=BF16)
    w8 = torch.zeros(6144, 4096, dtype=torch.float8_e4m3fn)
    s8 = torch.ones(48, 32)
    w8_gate_up, s8_gate_up = torch.zeros(2 * 14336, 4096, dtype=torch.float8_e4m3fn), torch.ones(224, 32)
    w = torch.randn(6144, 4096, dtype=BF16)
    w_gate_up = torch.zeros(2 * 14336, 4096, dtype=BF16)
    # DeepSeek-V3's routed experts, [2 x 2048, 7168] each (8 of its 256: the count sets no tile); 32 rows routed
    experts, expert_scales = torch.zeros(8, 4096, 7168, dtype=torch.float8_e4m3fn), torch.ones(8, 32, 56)
    routed, ends = torch.randn(32, 7168, dtype=BF16), torch.arange(4, 33, 4, dtype=torch.int32)
    # gpt-oss-120b's MXFP4 experts, gate_up [5760, 2880] (90 groups of 32), 8 of its 128
    fp4_blocks = torch.zeros(8, 5760, 90, 16, dtype=torch.uint8)
    fp4_scales = torch.zeros(8, 5760, 90, dtype=torch.uint8)
    fp4_rows = torch.randn(32, 2880, dtype=BF16)
    decode = paged_attention_launch([128 + 128 * i for i in range(32)], [1] * 32)
    verify = paged_attention_launch([100, 300, 700, 33], [4] * 4)
    prefill = paged_attention_launch([0], [2048])
    kc, vc = (torch.randn(32, hkv, 2120, d, dtype=BF16) for _ in range(2))
    ql = torch.randn(32, 1, hq, d, dtype=BF16).transpose(1, 2)
    return {
        "rope_write": lambda: launch_rope_write(q, k, cos, sin, *pools, v[0].transpose(0, 1), slots),
        "rope": lambda: launch_rope(q, cos, sin),
        "silu_mul": lambda: launch_silu_mul(gate_up[..., :14336], gate_up[..., 14336:]),
        "tap kernel (add, norm, store)": lambda: launch_tap_kernel(x1, x1, torch.ones(4096, dtype=BF16), None,
                                                                   torch.empty(3, 1, 4096, dtype=BF16), 1e-5, "rms",
                                                                   want_s=True, slot=1),
        "paged_write_pair": lambda: launch_paged_write(pools[0], k[0].transpose(0, 1), slots,
                                                       other=(pools[1], v[0].transpose(0, 1))),
        "paged_attention decode (plan)": decode,
        "paged_attention decode, three key loops": lambda: decode(phases=True),
        "paged_attention verify (plan)": verify,
        "paged_attention prefill (plan)": prefill,
        "cache_attention decode": lambda: launch_cache_attention(ql, kc, vc, torch.tensor([2112]), d ** -0.5),
        "gemv bf16": lambda: launch_gemv(x1, w, config=pick_config(*w.shape)),
        "gemv bf16, gate/up with silu_mul": lambda: launch_gemv(x1, w_gate_up, config=pick_config(*w_gate_up.shape),
                                                                glu=(0, 14336, 14336)),
        "gemv bf16, q/k/v with rope_write": lambda: launch_linear_rope_write(x1, w, None, None, 0, 0, *token),
        "fp8 gemv": lambda: launch_fp8_linear(x1, w8, s8, None, 128, 128),
        "fp8 gemv, q/k/v with rope_write": lambda: launch_linear_rope_write(x1, w8, None, s8, 128, 128, *token),
        "fp8 gemv, gate/up with silu_mul": lambda: launch_fp8_linear_silu_mul(x1, w8_gate_up, s8_gate_up, None, 128,
                                                                              128, 0, 14336, 14336),
        "fp8 gemm (split k)": lambda: launch_fp8_linear(x32, w8, s8, None, 128, 128),
        "fp8 grouped experts": lambda: launch_fp8_grouped_mm(routed, experts, expert_scales, ends, 128, 128),
        "paged latent attention, fp8 kv_b_proj": latent_fp8_launch(),
        "l2 prefetch (bulk)": lambda: prefetch.launch_prefetch(w8, 3 << 20),
        "mxfp4 grouped experts": lambda: launch_mxfp4_grouped_mm(fp4_rows, fp4_blocks, fp4_scales, ends),
        "mxfp4 grouped experts, split over 4": lambda: launch_mxfp4_grouped_mm(fp4_rows, fp4_blocks, fp4_scales, ends,
                                                                               config=(16, 64, 128, 4, 3, 4)),
    }


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("FAIL setup TRITON_INTERPRET=1: the kernels are interpreted, not compiled; run without it")
        return 1
    failed = 0
    every = launches()
    for name, launch in every.items():
        failed += not compiles(name, launch)
    with programmatic():
        for name in PROGRAMMATIC:
            failed += not compiles(f"pdl {name}", every[name], programmatic=True)
    return 1 if failed else 0


# The decode step's kernels, which take a PDL constexpr (``ppsplit.triton_kernels.common.launch_options``)
PROGRAMMATIC = ("rope_write", "rope", "silu_mul", "tap kernel (add, norm, store)", "paged_attention decode (plan)",
                "gemv bf16", "gemv bf16, gate/up with silu_mul", "gemv bf16, q/k/v with rope_write", "fp8 gemv",
                "fp8 gemv, gate/up with silu_mul", "fp8 gemv, q/k/v with rope_write", "fp8 gemm (split k)")


# Kernels whose fp32 quotients are rounded to a narrower type and must round as ATen does: their divisions IEEE
# (``tl.math.div_rn``). Triton's ``/`` is ``div.full.f32`` on the GPU, within 2 ulp, which the interpreter (numpy's
# IEEE division) never shows: it once moved a kernel's FP8 rounding of activations (bench/RESULTS.md section 37).
EXACT_DIVISION = ("silu_mul", "gemv bf16, gate/up with silu_mul", "fp8 gemv, gate/up with silu_mul")


@contextlib.contextmanager
def programmatic():
    """Launches as on an sm_90 GPU with programmatic dependent launch switched on."""
    from ppsplit.triton_kernels import common

    saved = common.supports_programmatic_launch
    common.supports_programmatic_launch = lambda t: True
    previous = common.programmatic_launch(True)
    try:
        yield
    finally:
        common.programmatic_launch(previous)
        common.supports_programmatic_launch = saved


def compiles(name: str, launch, programmatic: bool = False) -> bool:
    """Compile ``launch``'s kernels; print ``ok``/``FAIL``. ``programmatic``: each kernel must also wait for the
    previous one on the device, and the GEMVs and the GEMM prefetch their weights before they wait. The kernels of
    ``EXACT_DIVISION`` must hold no approximate division."""
    compiled: list = []
    try:
        with compile_only(compiled), torch.no_grad():
            launch()
    except Exception as e:  # a kernel the compiler rejects
        print(f"FAIL {name} {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        return False
    shared = max(k.metadata.shared for k in compiled)
    ok = bool(compiled) and shared <= SHARED_MEMORY
    if name.removeprefix("pdl ") in EXACT_DIVISION:
        ok = ok and all("div.full.f32" not in k.asm["ptx"] for k in compiled)
    if programmatic:
        ptx = [k.asm["ptx"] for k in compiled]
        ok = ok and all(k.metadata.launch_pdl and "griddepcontrol.wait" in p for k, p in zip(compiled, ptx))
        weights = [p for k, p in zip(compiled, ptx) if k.name != "split_sum_kernel"]  # it streams no weights
        if "gemv" in name or "gemm" in name:
            ok = ok and all(-1 < p.find("prefetch.global.L2") < p.find("griddepcontrol.wait") for p in weights)
    print(f"{'ok' if ok else 'FAIL'} {name} {len(compiled)} {shared}", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())

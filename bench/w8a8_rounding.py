"""Why the W8A8 kernel missed torch's quantisation at 32 rows on the H200 (bench/RESULTS.md sections 34 and 37), on
the CPU: the GPU test's inputs, quantised as torch does (IEEE ``amax / 448``, then ``x / scale``), against the same
with the scale from an approximate division (``amax * (1 / 448)``, what ``div.full.f32`` computes up to its last
bit). Prints, per row count, how many activation groups get another scale and how far the products move, in the
test's tolerance (2e-2 + 1e-2 |ref|).

    python bench/w8a8_rounding.py
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8 import quantize  # noqa: E402

FP8 = torch.float8_e4m3fn
GROUP = 128


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random ``[n, k]`` weight as its FP8 128x128 blocks (``bench/fp8.py``'s ``quantize``) dequantise it, in
    fp64."""
    q, scale = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), GROUP)
    return (q.double().view(n // GROUP, GROUP, k // GROUP, GROUP) * scale.double()[:, None, :, None]).view(n, k)


def product(x: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` quantised per group by ``scale`` (IEEE quotient, FP8 rounding), dequantised, times ``w^T`` in fp64."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    return ((groups / scale).to(FP8).double() * scale.double()).flatten(1) @ w.T


def main() -> None:
    w = weight(640, 1024)
    print("rows  groups  scales moved  max |diff|  outside tolerance")
    for m in (1, 5, 32):
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        if m > 1:
            x[1] = 0
        amax = x.float().unflatten(-1, (-1, GROUP)).abs().amax(-1, keepdim=True)
        ieee = amax / 448.0
        approx = amax * torch.tensor(1 / 448.0)
        ieee, approx = (torch.where(s > 0, s, torch.ones_like(s)) for s in (ieee, approx))
        ref, got = product(x, ieee, w), product(x, approx, w)
        diff = (got - ref).abs()
        bad = diff > 2e-2 + 1e-2 * ref.abs()
        print(f"{m:4d}  {ieee.numel():6d}  {int((ieee != approx).sum()):12d}  {diff.max().item():10.3f}"
              f"  {100 * bad.double().mean().item():16.1f}%")


if __name__ == "__main__":
    main()

"""Core: the quantisation record of a compiled folder (``manifest.json``'s ``quantization``), plain data.

A quantised checkpoint's linears keep their FP8 weights and scales as shipped; each stage program calls
``ppsplit::fp8_linear(x, weight, scale, bias, block_n, block_k)`` on them (``ppsplit.triton_kernels.fp8``), and on a
stack of MoE experts ``[E, N, K]`` (scales ``[E, ...]``, one grid per expert) ``ppsplit::fp8_grouped_mm`` or
``ppsplit::fp8_expert_weights``. The three scale layouts are one rule, a scale per ``[block_n, block_k]`` block:

    method               scheme   checkpoint scale                 block
    fp8                  block    weight_scale_inv [ceil(N/bn), ceil(K/bk)]   weight_block_size (bn, bk)
    fp8                  tensor   weight_scale_inv []                (N, K)
    compressed-tensors   channel  weight_scale [N, 1]                (1, K)
    compressed-tensors   tensor   weight_scale [1]                   (N, K)
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = {"fp8": ("block", "tensor"), "compressed-tensors": ("channel", "tensor"), "mxfp4": ("experts",)}
WEIGHT_DTYPES = ("float8_e4m3fn",)
SCALE_DTYPES = ("float32", "bfloat16", "float16")


def describe_supported() -> str:
    return ("block-scaled FP8 (quant_method 'fp8', float8_e4m3fn weights with weight_scale_inv, float or ue8m0 "
            "scales, dynamic activations), compressed-tensors FP8 (format 'float-quantized', channel or tensor weight "
            "scales) and MXFP4 experts (quant_method 'mxfp4')")


@dataclass(frozen=True)
class Quantization:
    """How the folder's weights are quantised. ``linears[k]``: stage ``k``'s FP8 weights (linears, and stacks of MoE
    experts); ``dequantized[k]``: its tensors the compile had to dequantise to the model dtype (experts that are not
    whole blocks, weights read by something other than ppsplit's FP8 ops), which cost their full size."""

    method: str
    scheme: str
    block: tuple[int, int] | None = None
    weight_dtype: str = "float8_e4m3fn"
    linears: tuple[int, ...] = ()
    dequantized: tuple[int, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS or self.scheme not in METHODS[self.method]:
            raise ValueError(f"quantization {self.method!r} / {self.scheme!r} is not one ppsplit reads: "
                             f"{describe_supported()}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"quantized weight dtype {self.weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
        if self.scheme == "block" and (self.block is None or min(self.block) < 1):
            raise ValueError("block-scaled FP8 needs a positive block size [block_n, block_k]")

    def describe(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 experts (*_blocks + *_scales) as stored, decoded in the expert kernels"
        how = f"{self.block[0]}x{self.block[1]} blocks" if self.scheme == "block" else f"per-{self.scheme} scales"
        return f"{self.method} {self.weight_dtype} weights, {how}, weight-only (activations in the model dtype)"

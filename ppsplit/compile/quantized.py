"""Driver support: reading a quantised checkpoint's ``quantization_config`` (block-scaled FP8, compressed-tensors
FP8), pairing each FP8 weight with its scale, and dequantising the ones that cannot stay FP8.

Everything else is refused here with one line naming the scheme and what is supported. The folder records the
result as ``ppsplit.core.quant.Quantization``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.quant import describe_supported
from ppsplit.triton_kernels.fp8 import dequantize, scale_grid
from ppsplit.triton_kernels.mxfp4 import dequantize_mxfp4

_SCALE_DTYPES = ("F32", "BF16", "F16")
_EXPONENT_DTYPES = ("F8_E8M0", "U8")  # scale_fmt "ue8m0": one E8M0 exponent per block, the scale 2 ** (e - 127)


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantisation: ``block`` (bn, bk) for block scales, ``None`` for per-channel or per-tensor
    (read from each scale's shape); ``suffix``: the scale tensor beside ``<module>.weight``; ``exponents``: the scales
    may be stored as E8M0 exponents (``scale_fmt: "ue8m0"``, DeepSeek-V3.1's and transformers' MXFP8 layout)."""

    method: str
    scheme: str
    block: tuple[int, int] | None
    suffix: str
    exponents: bool = False

    def block_of(self, shape) -> tuple[int, int]:
        n, k = shape
        return self.block if self.scheme == "block" else (1, k) if self.scheme == "channel" else (n, k)


def _field(quant, key, default=None):
    value = quant.get(key, default) if isinstance(quant, dict) else getattr(quant, key, default)
    return getattr(value, "value", value)


def read_scheme(config, name: str) -> Scheme | None:
    """The quantisation of ``config`` (a transformers config), ``None`` when it has none; a ``ConfigError`` naming the
    scheme for anything ppsplit does not read."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    method = _field(quant, "quant_method") or "unknown"

    def refuse(what: str):
        raise ConfigError(f"{name}: quantization_config {what} is not supported; ppsplit compile reads "
                          f"{describe_supported()}, and unquantized float32/float16/bfloat16 weights")

    if method == "fp8":
        if _field(quant, "activation_scheme", "dynamic") != "dynamic":
            refuse(f"quant_method 'fp8' with activation_scheme {_field(quant, 'activation_scheme')!r}")
        scale_fmt = _field(quant, "scale_fmt")
        if scale_fmt not in (None, "float", "float32", "fp32", "ue8m0"):
            refuse(f"quant_method 'fp8' with scale_fmt {scale_fmt!r}")
        if _field(quant, "fmt", "e4m3") != "e4m3":
            refuse(f"quant_method 'fp8' with fmt {_field(quant, 'fmt')!r}")
        block = _field(quant, "weight_block_size")
        exponents = scale_fmt == "ue8m0"
        if block is None:
            return Scheme("fp8", "tensor", None, "weight_scale_inv", exponents)
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            refuse(f"weight_block_size {block!r} (want two positive integers)")
        return Scheme("fp8", "block", (block[0], block[1]), "weight_scale_inv", exponents)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, refuse)
    if method == "mxfp4":
        return Scheme("mxfp4", "experts", None, "_scales")
    refuse(f"quant_method {method!r}")


def _compressed_tensors(quant, refuse) -> Scheme:
    fmt = _field(quant, "format")
    if fmt != "float-quantized":
        refuse(f"compressed-tensors format {fmt!r}")
    groups = _field(quant, "config_groups") or {}
    strategies = set()
    for gname, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or weights.get("symmetric") is False:
            refuse(f"compressed-tensors group {gname!r} weights {weights!r} (want symmetric 8-bit float)")
        if weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
            refuse(f"compressed-tensors group {gname!r} weight strategy {weights.get('strategy')!r}")
        acts = (group or {}).get("input_activations")
        if acts and not acts.get("dynamic"):
            refuse(f"compressed-tensors group {gname!r} with static input activation scales")
        strategies.add(weights["strategy"])
    if len(strategies) != 1:
        refuse(f"compressed-tensors with weight strategies {sorted(strategies) or 'none'} (want one)")
    return Scheme("compressed-tensors", strategies.pop(), None, "weight_scale")


def pair_scales(checkpoint, scheme: Scheme) -> dict[str, str]:
    """``{FP8 weight key: its scale key}`` over the checkpoint's headers, each pair checked (dtype, shapes); for
    MXFP4 ``{<name>_blocks: <name>_scales}``."""
    if scheme.method == "mxfp4":
        return _pair_mxfp4(checkpoint)
    pairs = {}
    for key in checkpoint.where:
        raw = checkpoint.raw_range(key)
        if raw.dtype != "F8_E4M3":
            continue
        if not key.endswith(".weight"):
            raise ConfigError(f"the checkpoint's FP8 tensor {key} is not a module's weight; ppsplit reads FP8 weights "
                              f"with a {scheme.suffix} beside them")
        scale = key[:-len("weight")] + scheme.suffix
        if scale not in checkpoint:
            raise ConfigError(f"the checkpoint's FP8 weight {key} has no {scale}; the checkpoint is incomplete")
        check_pair(key, raw.shape, scale, checkpoint.raw_range(scale), scheme)
        pairs[key] = scale
    return pairs


def _pair_mxfp4(checkpoint) -> dict[str, str]:
    pairs = {}
    for key in checkpoint.where:
        if not key.endswith("_blocks"):
            continue
        scale = key[:-len("_blocks")] + "_scales"
        blocks = checkpoint.raw_range(key)
        if scale not in checkpoint:
            raise ConfigError(f"the checkpoint's MXFP4 tensor {key} has no {scale}; the checkpoint is incomplete")
        scales = checkpoint.raw_range(scale)
        if blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) < 2 or blocks.shape[-1] != 16 \
                or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ConfigError(f"the checkpoint's {key} ({blocks.dtype} {tuple(blocks.shape)}) and {scale} "
                              f"({scales.dtype} {tuple(scales.shape)}) are not MXFP4 blocks [..., G, 16] and E8M0 "
                              "scales [..., G] (both U8)")
        pairs[key] = scale
    return pairs


def mxfp4_as_model_weights(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 experts ``[E, N, K/32, 16]`` as the model's ``[E, K, N]`` parameter in ``dtype``: the values transformers'
    ``convert_moe_packed_tensors`` gives (``ppsplit.triton_kernels.mxfp4.dequantize_mxfp4``), each expert
    transposed as it transposes them (for experts a stage does not keep as stored)."""
    return dequantize_mxfp4(blocks, scales, dtype).transpose(-2, -1).contiguous()


def check_pair(key: str, shape, scale_key: str, scale, scheme: Scheme) -> None:
    allowed = _SCALE_DTYPES + (_EXPONENT_DTYPES if scheme.exponents else ())
    if scale.dtype not in allowed:
        raise ConfigError(f"the checkpoint's {scale_key} is {scale.dtype}; scales must be one of {', '.join(allowed)}"
                          + ("" if scheme.exponents else " (E8M0 exponents need scale_fmt 'ue8m0')"))
    if len(shape) != 2:
        raise ConfigError(f"the checkpoint's FP8 weight {key} has shape {tuple(shape)}; ppsplit reads 2-D FP8 weights")
    grid = scale_grid(*shape, *scheme.block_of(shape))
    want = {"block": [grid], "channel": [(shape[0], 1), (shape[0],)], "tensor": [(), (1,)]}[scheme.scheme]
    if tuple(scale.shape) not in want:
        raise ConfigError(f"the checkpoint's {scale_key} has shape {tuple(scale.shape)}, but {key} {tuple(shape)} with "
                          f"{scheme.scheme} scales{f' of blocks {scheme.block}' if scheme.block else ''} needs "
                          f"{want[0]}; the checkpoint does not match its quantization_config")
    assert math.prod(scale.shape) == math.prod(grid)


def is_exponents(raw_dtype: str) -> bool:
    """Whether a scale stored as ``raw_dtype`` (a safetensors dtype) holds E8M0 exponents, not values."""
    return raw_dtype in _EXPONENT_DTYPES


def exponent_values(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (their bytes) as the fp32 scales they stand for, ``2 ** (e - 127)``, exactly (as transformers'
    ``Fp8Dequantize`` reads them); the byte 255 (E8M0's NaN) gives NaN."""
    e = exponents.view(torch.uint8).to(torch.float32)
    return torch.where(e == 255, torch.nan, (e - 127.0).exp2())


def dequantized(weight: torch.Tensor, scale: torch.Tensor, scheme: Scheme, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight as ``dtype`` (for tensors that cannot stay FP8)."""
    return dequantize(weight, scale, *scheme.block_of(weight.shape), dtype)

"""Tracing support: a model transformers loaded with an FP8 ``quantization_config`` on a GPU keeps its FP8 weights in
``FP8Linear`` and ``FP8Experts`` modules, whose forwards call kernels from the hub or DeepGEMM that no graph holds.
While tracing, each such module runs ppsplit's FP8 ops on its own tensors instead (``ppsplit::fp8_linear``;
``ppsplit::fp8_grouped_mm`` for experts, routed as transformers' ``grouped_mm`` experts route them), so the stages
keep the FP8 weights as loaded. (On a CPU transformers dequantises on load: there is nothing to do.)

The modules are recognised by their tensors, not their class: an FP8 ``weight`` with a ``weight_scale_inv`` beside
it (a linear), FP8 ``gate_up_proj`` / ``up_proj`` and ``down_proj`` stacks with ``*_scale_inv`` (experts). E8M0
scales (``scale_fmt: "ue8m0"``, ``float8_e8m0fnu`` powers of two) are widened to their fp32 values for the trace, as
the compile widens them, so the stages hold fp32 scales and the model gets its own back. What the ops cannot run is
refused in one line: static activation scales, biased or expert-parallel experts.
"""
from __future__ import annotations

import contextlib
import functools

import torch

import ppsplit.triton_kernels.fp8  # noqa: F401  (registers torch.ops.ppsplit.fp8_*)
from ppsplit.core.errors import ConfigError

_FP8 = torch.float8_e4m3fn


@contextlib.contextmanager
def traceable_fp8_modules(model: torch.nn.Module):
    """Within the block, the FP8 modules of ``model`` run ppsplit's ops (see the module docstring)."""
    patched, widened = [], []
    try:
        for name, module in model.named_modules():
            forward = _fp8_forward(name, module, widened)
            if forward is not None:
                module.forward = forward  # an instance attribute: the class's forward is untouched
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
        for module, scale_name, scale in widened:
            setattr(module, scale_name, scale)


def _fp8_forward(name: str, module: torch.nn.Module, widened: list):
    weight = module._parameters.get("weight")
    if isinstance(module, torch.nn.Linear) and weight is not None and weight.dtype == _FP8:
        return functools.partial(_linear, module, _block(name, module, "weight_scale_inv", weight, widened))
    up = next((p for p in ("gate_up_proj", "up_proj") if module._parameters.get(p) is not None), None)
    if up is not None and module._parameters[up].dtype == _FP8:
        if getattr(module, f"{up}_bias", None) is not None or getattr(module, "_is_expert_parallel", False):
            raise ConfigError(f"{name}: FP8 experts with biases or expert parallelism are not supported by "
                              "split_model; compile the checkpoint (ppsplit compile) instead")
        blocks = {p: _block(name, module, f"{p}_scale_inv", getattr(module, p), widened) for p in (up, "down_proj")}
        return functools.partial(_experts, module, up, blocks)
    return None


def _block(name: str, module, scale_name: str, weight: torch.Tensor, widened: list) -> tuple[int, int]:
    """The ``(block_n, block_k)`` of ``weight``'s scale ``scale_name``, checked; a one-line refusal otherwise. E8M0
    scales are replaced by their fp32 values, and ``(module, scale_name, scale)`` appended to ``widened``."""
    scale = getattr(module, scale_name, None)
    if scale is None or getattr(module, "activation_scale", None) is not None \
            or getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{name}: an FP8 weight without {scale_name}, or with static activation scales, which "
                          "ppsplit's FP8 ops do not run; load the model with dynamic activation scales")
    if scale.dtype == torch.float8_e8m0fnu:  # 2 ** (e - 127): exact in fp32
        widened.append((module, scale_name, scale))
        setattr(module, scale_name, torch.nn.Parameter(scale.to(torch.float32), requires_grad=False))
    elif not scale.dtype.is_floating_point or scale.dtype.itemsize < 2:
        raise ConfigError(f"{name}: {scale_name} is {scale.dtype}; split_model runs fp16/bf16/fp32 scales, or E8M0 "
                          "exponents as float8_e8m0fnu: load the model with one of those, or compile the checkpoint "
                          "(ppsplit compile)")
    size = getattr(module, "block_size", None)
    return tuple(size) if size is not None else tuple(weight.shape[-2:])  # per tensor: one block


def _linear(module, block, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.ppsplit.fp8_linear(x, module.weight, module.weight_scale_inv, module.bias, *block)


def _experts(module, up: str, blocks: dict, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts (routed pairs sorted by expert, each expert's rows multiplied by its
    weights, the results weighted and summed back per token) on the FP8 stacks."""
    top_k = top_k_index.shape[-1]
    tokens, width = hidden.shape
    ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden[perm // top_k]
    pair_weights = top_k_weights.reshape(-1)[perm]
    counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=module.num_experts, min=0,
                         max=module.num_experts - 1)
    ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = torch.ops.ppsplit.fp8_grouped_mm(x, getattr(module, up), getattr(module, f"{up}_scale_inv"), ends,
                                         *blocks[up])
    h = module._apply_gate(h) if up == "gate_up_proj" else module.act_fn(h)
    h = torch.ops.ppsplit.fp8_grouped_mm(h, module.down_proj, module.down_proj_scale_inv, ends, *blocks["down_proj"])
    h = h * pair_weights.to(h.dtype).unsqueeze(-1)
    unsort = torch.empty_like(perm)
    unsort[perm] = torch.arange(perm.shape[0], device=perm.device)
    return h[unsort].view(tokens, top_k, width).sum(dim=1).to(hidden.dtype)

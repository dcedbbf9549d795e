"""Core: where a model's decoder layers live (the ModuleList a pipeline is cut along), found without tracing.

No per-architecture code: the layers are the ``nn.ModuleList`` whose entries are the model's ``_no_split_modules``
classes, or failing that the ModuleList with ``num_hidden_layers`` entries. The trace pass and the torch.compile
backend both use it; it imports torch only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppsplit.core.errors import LayersNotFoundError


@dataclass(frozen=True)
class LayerStack:
    """Where the decoder layers live: ``model.get_submodule(fqn)`` is an ``nn.ModuleList`` of ``num_layers``."""

    fqn: str
    num_layers: int
    layer_class: str


def find_layers(model: torch.nn.Module, layers: str | None = None) -> LayerStack:
    """Locate the decoder-layer ModuleList of ``model``, or check the one named by ``layers``.

    Example::

        find_layers(LlamaForCausalLM(cfg))  # LayerStack(fqn="model.layers", num_layers=32, ...)
    """
    if layers is not None:
        try:
            mod = model.get_submodule(layers)
        except AttributeError:
            raise LayersNotFoundError(f"layers={layers!r} names no submodule of {type(model).__name__}; "
                                      "pass the dotted name of its decoder-layer ModuleList, e.g. 'model.layers'") from None
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) == 0:
            raise LayersNotFoundError(f"layers={layers!r} is a {type(mod).__name__}, not a non-empty nn.ModuleList of "
                                      "decoder layers; pass the dotted name of the ModuleList, e.g. 'model.layers'")
        return LayerStack(layers, len(mod), type(mod[0]).__name__)

    no_split = set(getattr(model, "_no_split_modules", None) or ())
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    expected = getattr(text_config, "num_hidden_layers", None)
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, torch.nn.ModuleList) and len(mod)]
    by_class = [(n, m) for n, m in lists if all(type(c).__name__ in no_split for c in m)]
    by_count = [(n, m) for n, m in lists if len(m) == expected]
    for candidates in (by_class, by_count):
        if len(candidates) > 1:
            exact = [(n, m) for n, m in candidates if len(m) == expected]
            candidates = exact or candidates
        if len(candidates) == 1:
            name, mod = candidates[0]
            return LayerStack(name, len(mod), type(mod[0]).__name__)
        if len(candidates) > 1:
            names = ", ".join(n for n, _ in candidates)
            raise LayersNotFoundError(f"{type(model).__name__} has several candidate decoder-layer lists ({names}); "
                                      "pass layers='<name>' to choose one")
    raise LayersNotFoundError(
        f"could not find the decoder layers of {type(model).__name__}: no nn.ModuleList of its _no_split_modules "
        f"classes ({', '.join(sorted(no_split)) or 'none declared'}) and none with num_hidden_layers={expected} "
        "entries; pass layers='<dotted name of the decoder-layer ModuleList>'")

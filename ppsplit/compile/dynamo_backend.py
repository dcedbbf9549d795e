"""A ``torch.compile`` backend that stores ppsplit's taps from inside the compiled graph.

``torch.compile(model, backend="ppsplit")`` (registered through the ``torch_dynamo_backends`` entry point) or
``torch.compile(model, backend=ppsplit.backend(aux=[2, 16, 29], aux_out=buf))``: every graph Dynamo captures
is searched for decoder layers, a store of each tap's value is inserted into the graph, and the graph goes on
to the inner backend (Inductor by default). Tap ``j`` is the residual stream entering decoder layer ``j``
(``output_hidden_states[j]``); tap ``L`` is the last layer's output before the final norm.

Design (why it works at the Dynamo level and how it survives CUDA graphs):

- The taps are found on Dynamo's torch-level graph, before AOTAutograd: each node's decoder layer is the
  innermost module of its ``nn_module_stack`` that is an entry of the layer ``nn.ModuleList`` that
  ``find_layers`` locates (``_no_split_modules`` classes, as in ``split_model``). Modules are resolved to
  objects through the frame Dynamo is compiling, so a graph break that compiles one decoder layer as its own
  frame still knows the layer's index. Tap ``j`` is the one value from outside layer ``j`` that its nodes read
  with the layer output's shape and dtype.
- The store is ``aux[slot, :B, :T].copy_(value)`` written as plain torch ops, so Inductor fuses it into the
  kernel that already produces the value (the residual add) instead of launching a copy.
- The buffer is a buffer of the captured graph module (a ``get_attr``), not a graph input. AOTAutograd lifts it
  like a parameter, so it is a *static* input of the compiled graph: Inductor writes it in place, and the
  CUDA-graph tree accepts the mutation (it skips graphs that mutate non-static inputs, "mutated inputs").
  HF's ``StaticCache`` relies on the same rule for its KV tensors (``mark_static_address``).
"""
from __future__ import annotations

import gc
import logging
import os
import re
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
from torch import fx

from ppsplit.core.errors import ConfigError, LayersNotFoundError

# --- ppsplit internals: imported here and nowhere else in this module ---
from ppsplit.core.options import SplitOptions
from ppsplit.core.layers import LayerStack, find_layers
# -------------------------------------------------------------------------

log = logging.getLogger("ppsplit")

Aux = Union[None, str, int, Sequence[int]]
BUFFER = "ppsplit_aux"


def _store_tap(aux: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    """``aux[slot, :B, :T] = value``: the op the backend inserts (plain torch ops, so Inductor can fuse it)."""
    torch._check(value.shape[0] <= aux.shape[1], lambda: "batch exceeds the taps buffer; pass max_batch=")
    torch._check(value.shape[1] <= aux.shape[2], lambda: "tokens exceed the taps buffer; pass max_tokens=")
    aux[slot, : value.shape[0], : value.shape[1]].copy_(value)


@dataclass(frozen=True)
class _Layer:
    """A decoder layer found in a model: its index and the model's layer stack."""

    index: int
    stack: LayerStack


class TapBackend:
    """A ``torch.compile`` backend that writes the taps ``aux`` of every call into one buffer.

    ``aux``: ``"eagle3"`` (``2, L//2, L-3``), ids ``"2,16,29"`` / ``[2, 16, 29]`` (vLLM numbering, or
    ``aux_convention="sglang"``). ``aux_out``: the caller's buffer ``[n_slots, B_max, T_max, H]`` (on the
    model's device; any float dtype); a call with ``B`` sequences of ``T`` tokens writes ``aux_out[:, :B, :T]``.
    Without ``aux_out`` the first compiled graph allocates one of ``max_batch x max_tokens`` (default: the
    batch and length of that first call); ``taps()`` returns the last call's part of it. ``inner``:
    ``"inductor"`` (default), ``"eager"``, ``"aot_eager"``, any registered backend name, or a callable
    ``(gm, example_inputs) -> callable``. ``mode``/``options`` given to ``torch.compile`` go to Inductor.

    Example::

        buf = torch.empty(3, 1, 4096, model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
        step = torch.compile(model, backend=ppsplit.backend(aux=[2, 16, 29], aux_out=buf), mode="reduce-overhead")
        logits = step(input_ids).logits            # buf[:, :1, :T] now holds taps 2, 16 and 29
    """

    def __init__(self, aux: Aux = "eagle3", *, inner: str | Callable = "inductor", aux_out: torch.Tensor | None = None,
                 max_batch: int | None = None, max_tokens: int | None = None, layers: str | None = None,
                 aux_convention: str = "vllm"):
        self.options = SplitOptions(pp=1, aux=aux, aux_convention=aux_convention, layers=layers)  # validates aux
        if aux is None or aux == "":
            raise ConfigError("aux must name at least one tap ('eagle3' or ids like '2,16,29'), but got "
                              f"{aux!r}; without taps use backend='inductor'")
        if not (isinstance(inner, str) or callable(inner)):
            raise ConfigError(f"inner must be a backend name ('inductor', 'eager', 'aot_eager', ...) or a callable "
                              f"(gm, example_inputs) -> callable, but got {inner!r}")
        for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive int, but got {value!r}")
        if aux_out is not None and (not isinstance(aux_out, torch.Tensor) or aux_out.dim() != 4):
            raise ConfigError(f"aux_out must be a tensor [n_slots, B, T, H], but got "
                              f"{getattr(aux_out, 'shape', type(aux_out).__name__)}")
        self.inner = inner
        self.aux_out = aux_out
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.taps_of: dict[int, tuple[int, ...]] = {}  # num_layers -> tap ids
        self.stored: set[int] = set()                   # tap ids some compiled graph stores
        self.last_shape: tuple[int, int] | None = None
        self._layers: dict[int, tuple[weakref.ref, _Layer]] = {}
        self._searched: set[int] = set()

    # --- the backend ---------------------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs) -> Callable:
        stores, shape_of = self._insert_taps(gm)
        compiled = self._compile_inner(gm, example_inputs, kwargs)
        return _recording(compiled, shape_of, self) if stores else compiled

    def taps(self) -> torch.Tensor:
        """The taps of the last call: ``aux_out[:, :B, :T]`` ``[n_slots, B, T, H]``, slot order = sorted tap ids.

        Example::

            logits = compiled(input_ids).logits
            features = backend.taps()            # [3, B, T, H]
        """
        if self.aux_out is None or not self.stored:
            raise LayersNotFoundError(
                "no compiled graph stored a tap: ppsplit found no decoder layers in what torch.compile captured "
                "(run the compiled model first; for a model whose layer list it cannot find, pass "
                "layers='<dotted name of the decoder-layer ModuleList>')")
        if self.last_shape is None:
            return self.aux_out
        b, t = self.last_shape
        return self.aux_out[:, :b, :t]

    def _compile_inner(self, gm: fx.GraphModule, example_inputs: list, kwargs: dict) -> Callable:
        inner = self.inner
        if inner == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = dict(list_mode_options(kwargs.get("mode")) if kwargs.get("mode") else {})
            patches.update(kwargs.get("options") or {})
            return compile_fx(gm, example_inputs, config_patches=patches or None)
        if kwargs:
            log.warning("ppsplit backend: inner backend %r ignores torch.compile's %s", inner, sorted(kwargs))
        if isinstance(inner, str):
            from torch._dynamo.backends.registry import lookup_backend

            try:
                inner = lookup_backend(inner)
            except Exception:
                from torch._dynamo.backends.registry import list_backends

                raise ConfigError(f"inner={self.inner!r} is not a registered torch.compile backend; use one of "
                                  f"{', '.join(list_backends())} or a callable") from None
        return inner(gm, example_inputs)

    # --- finding the layers and the taps -------------------------------------------------------------------
    def _insert_taps(self, gm: fx.GraphModule):
        """Insert the tap stores this graph owns; returns whether it stores any, and a function args -> (B, T)."""
        layer_of, unknown = self._layer_of_nodes(gm)
        by_layer: dict[int, list[fx.Node]] = {}
        stack = None
        for node, layer in layer_of.items():
            by_layer.setdefault(layer.index, []).append(node)
            stack = layer.stack
        if stack is None:
            if unknown:
                warnings.warn(f"ppsplit backend: skipped the taps of a compiled graph ({len(gm.graph.nodes)} nodes): it "
                              f"runs {', '.join(sorted(unknown))} code, but no decoder-layer list of a model holds "
                              "these modules, so their layer index is unknown; taps computed there are not stored",
                              stacklevel=2)
            return False, None
        taps = self._taps(stack.num_layers)
        outputs = {j: _layer_output(gm, nodes) for j, nodes in by_layer.items()}
        stores = []
        for slot, tap in enumerate(taps):
            if tap < stack.num_layers and tap in by_layer:
                value = _layer_input(by_layer[tap], outputs[tap], outputs.get(tap - 1))
                what = f"the residual stream entering decoder layer {tap}"
            elif tap == stack.num_layers and tap - 1 in by_layer:
                value, what = outputs[tap - 1], f"the output of the last decoder layer ({tap - 1})"
            else:
                continue  # another graph (or none) runs that layer
            if value is None or _val(value) is None or _val(value).dim() != 3:
                warnings.warn(f"ppsplit backend: skipped tap {tap}: {what} is not one [batch, tokens, hidden] tensor "
                              "in the captured graph", stacklevel=2)
                continue
            stores.append((slot, tap, value))
        if not stores:
            return False, None
        aux = self._buffer(len(taps), _val(stores[0][2]))
        _attach_buffer(gm, aux)
        graph = gm.graph
        last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
        for slot, tap, value in stores:
            anchor = last_placeholder if value.op == "placeholder" else value
            with graph.inserting_after(anchor):
                attr = graph.get_attr(BUFFER)
            with graph.inserting_after(attr):
                graph.call_function(_store_tap, (attr, slot, value))
            self.stored.add(tap)
        graph.lint()
        gm.recompile()
        log.info("ppsplit backend: graph stores taps %s", [t for _, t, _ in stores])
        return True, _shape_getter(gm, _val(stores[0][2]))

    def _taps(self, num_layers: int) -> tuple[int, ...]:
        if num_layers not in self.taps_of:
            self.taps_of[num_layers] = self.options.taps(num_layers)
        return self.taps_of[num_layers]

    def _buffer(self, n_slots: int, value) -> torch.Tensor:
        """The caller's buffer, checked against this graph's tap value, or a new one."""
        batch, tokens, hidden = (_hint(d) for d in value.shape)
        if self.aux_out is None:
            self.aux_out = torch.zeros(n_slots, self.max_batch or batch, self.max_tokens or tokens, hidden,
                                       dtype=value.dtype, device=value.device)
        aux = self.aux_out
        want = f"[{n_slots}, >={batch}, >={tokens}, {hidden}] on {value.device}"
        if aux.shape[0] != n_slots or aux.shape[3] != hidden or aux.device != value.device:
            raise ConfigError(f"aux_out is {list(aux.shape)} on {aux.device}, but these taps need {want}; "
                              "allocate it as torch.empty(n_slots, max_batch, max_tokens, hidden_size)")
        if aux.shape[1] < batch or aux.shape[2] < tokens:
            raise ConfigError(f"the taps buffer is {list(aux.shape)}, too small for a call of {batch} sequences of "
                              f"{tokens} tokens ({want}); pass a larger aux_out, or max_batch= / max_tokens=")
        return aux

    def _layer_of_nodes(self, gm: fx.GraphModule) -> tuple[dict[fx.Node, _Layer], set[str]]:
        """Each node's decoder layer, from the modules of its ``nn_module_stack`` resolved in Dynamo's frame."""
        scope = _frame_scope()
        objects: dict[str, object] = {}

        def resolve(path: str):
            if path not in objects:
                try:
                    # "L['self'].model.layers.3@1" -> L['self'].model.layers[3] (the "@n" marks a repeated call)
                    expr = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", path.split("@", 1)[0])
                    objects[path] = eval(expr, {"__builtins__": {}}, scope)  # noqa: S307  (Dynamo's own paths)
                except Exception:
                    objects[path] = None
            return objects[path]

        frame_self = scope.get("L", {}).get("self")
        stacks = {n: list((n.meta.get("nn_module_stack") or {}).values()) for n in gm.graph.nodes
                  if n.op == "call_function" or n.op == "call_method" or n.op == "call_module"}
        modules = [m for m in [frame_self] + [resolve(p) for s in stacks.values() for p, _ in s]
                   if isinstance(m, torch.nn.Module)]
        for m in modules:
            self._register(m)
        if not any(self._layer(m) for m in modules) and modules:
            self._search_owners(modules)
        layer_of: dict[fx.Node, _Layer] = {}
        for node, stack in stacks.items():
            found = None
            for path, _ in reversed(stack):
                found = self._layer(resolve(path))
                if found:
                    break
            found = found or self._layer(frame_self)
            if found:
                layer_of[node] = found
        if self._layer(frame_self) and not self._guard_layer_frame(self._layer(frame_self)):
            return {}, {f"{type(frame_self).__name__} (no guard on the layer object)"}
        unknown = set()
        if not layer_of:
            layer_classes = {c for m in modules for c in (getattr(type(m), "_no_split_modules", None) or ())}
            unknown = {type(m).__name__ for m in modules if type(m).__name__ in layer_classes or _looks_like_layer(m)}
        return layer_of, unknown

    def _guard_layer_frame(self, layer: _Layer) -> bool:
        """A graph break made Dynamo compile one decoder layer's forward as a frame of its own. Dynamo would
        reuse that graph for every layer of the class (their weights are graph inputs), but its tap stores
        belong to this layer: guard on the layer object, and allow one compile per layer."""
        try:  # Dynamo internals: without them, storing here could write another layer's value
            from torch._dynamo.guards import GuardBuilder, install_guard
            from torch._dynamo.source import LocalSource

            install_guard(LocalSource("self", is_input=True).make_guard(GuardBuilder.ID_MATCH))
        except Exception as e:
            log.warning("ppsplit backend: could not guard a decoder-layer graph on its layer: %s", e)
            return False
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older name
        need = layer.stack.num_layers + 8
        if getattr(config, name) < need:
            warnings.warn(f"ppsplit backend: a graph break inside the decoder layers compiles each of the "
                          f"{layer.stack.num_layers} layers on its own; raising torch._dynamo.config.{name} "
                          f"from {getattr(config, name)} to {need}", stacklevel=3)
            setattr(config, name, need)
        return True

    def _register(self, model: torch.nn.Module) -> None:
        """Remember the decoder layers of ``model`` (a Hugging Face model: it has a ``config``)."""
        if id(model) in self._searched or getattr(model, "config", None) is None:
            return
        self._searched.add(id(model))
        try:
            stack = find_layers(model, self.options.layers)
        except LayersNotFoundError:
            return
        for i, layer in enumerate(model.get_submodule(stack.fqn)):
            self._layers[id(layer)] = (weakref.ref(layer), _Layer(i, stack))

    def _layer(self, module) -> _Layer | None:
        entry = self._layers.get(id(module)) if isinstance(module, torch.nn.Module) else None
        return entry[1] if entry is not None and entry[0]() is module else None

    def _search_owners(self, modules: list) -> None:
        """A graph break can compile a decoder layer as a frame of its own, where its model is out of sight:
        find the models that hold these modules among all live ones (once per module, at compile time)."""
        todo = [m for m in modules if _looks_like_layer(m) and id(m) not in self._searched]
        if not todo:
            return
        for m in todo:
            self._searched.add(id(m))
        for obj in gc.get_objects():
            # type(), not isinstance(): a dead weakref.proxy raises on any attribute access
            if issubclass(type(obj), torch.nn.Module) and getattr(obj, "config", None) is not None:
                self._register(obj)


def _looks_like_layer(module: torch.nn.Module) -> bool:
    """A module whose class some loaded Hugging Face model declares as a decoder layer (``_no_split_modules``)."""
    name = type(module).__name__
    return any(name in (getattr(cls, "_no_split_modules", None) or ()) for cls in _model_classes())


def _model_classes():
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    seen, todo = [], [PreTrainedModel]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def _frame_scope() -> dict:
    """``{"L": locals, "G": globals}`` of the frame Dynamo is compiling (``nn_module_stack`` paths use them)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        tx = None
    if tx is None:  # not under Dynamo (a graph handed to the backend by hand), or a Dynamo that moved this
        log.warning("ppsplit backend: no Dynamo frame to resolve the graph's modules in; its taps are skipped")
        return {}
    tx = tx.output.root_tx
    return {"L": tx.f_locals, "G": tx.f_globals}


def _val(node: fx.Node):
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def _shape_key(v) -> tuple:
    # Strings, not SymInt comparisons: comparing symbolic sizes would add guards to the compiled graph.
    return tuple(str(d) for d in v.shape), v.dtype


def _layer_output(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.Node | None:
    """The layer's result: its last tensor node of rank >= 2 read outside the layer."""
    inside = set(nodes)
    outs = [n for n in nodes if _val(n) is not None and _val(n).dim() >= 2 and _val(n).is_floating_point()
            and any(u not in inside for u in n.users)]
    return outs[-1] if outs else None


def _layer_input(nodes: list[fx.Node], output: fx.Node | None, previous: fx.Node | None) -> fx.Node | None:
    """The residual stream entering a layer: the value from outside it with the layer output's shape and dtype."""
    if output is None:
        return None
    inside = set(nodes)
    key = _shape_key(_val(output))
    found = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in found and _val(a) is not None and _shape_key(_val(a)) == key:
                found.append(a)
    if len(found) > 1 and previous in found:
        return previous
    return found[0] if len(found) == 1 else None


def _hint(d) -> int:
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        return int(hint) if hint is not None else int(d.node.shape_env.size_hint(d.node.expr))
    return int(d)


def _shape_getter(gm: fx.GraphModule, value) -> Callable:
    """A cheap host-side function of the graph's inputs giving the tap value's (B, T): no device sync."""
    getters = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for d in value.shape[:2]:
        if not isinstance(d, torch.SymInt):
            getters.append(lambda args, d=int(d): d)
            continue
        expr, where = d.node.expr, None
        for i, p in enumerate(placeholders):
            v = p.meta.get("example_value")
            if isinstance(v, torch.SymInt) and v.node.expr == expr:
                where = (i, None)
            elif isinstance(v, torch.Tensor):
                for k, s in enumerate(v.shape):
                    if isinstance(s, torch.SymInt) and s.node.expr == expr:
                        where = (i, k)
                        break
            if where:
                break
        if where is None:
            return None  # a size derived from several inputs: taps() then returns the whole buffer
        i, k = where
        getters.append((lambda args, i=i: int(args[i])) if k is None else (lambda args, i=i, k=k: args[i].shape[k]))
    return lambda args: (getters[0](args), getters[1](args))


def _recording(compiled: Callable, shape_of: Callable | None, backend: TapBackend) -> Callable:
    """Wrap the compiled graph so ``taps()`` knows the last call's (B, T) (Dynamo calls it as ``fn(*args)``)."""
    def run(*args):
        backend.last_shape = shape_of(args) if shape_of is not None else None  # None: taps() gives the whole buffer
        return compiled(*args)
    return run


def _attach_buffer(gm: fx.GraphModule, aux: torch.Tensor) -> None:
    """Make ``aux`` a buffer of the graph module, so AOTAutograd lifts it as a static input of the graph."""
    gm.register_buffer(BUFFER, aux, persistent=False)
    names = getattr(gm, "_param_name_to_source", None)
    if isinstance(names, dict):  # Dynamo's record of where each lifted tensor comes from (checked by AOT)
        from torch._dynamo.source import ConstantSource

        names[BUFFER] = ConstantSource(BUFFER)


def backend(aux: Aux = "eagle3", *, inner: str | Callable = "inductor", aux_out: torch.Tensor | None = None,
            max_batch: int | None = None, max_tokens: int | None = None, layers: str | None = None,
            aux_convention: str = "vllm") -> TapBackend:
    """A ``torch.compile`` backend storing the taps ``aux`` into ``aux_out`` (see ``TapBackend``).

    Example::

        taps = ppsplit.backend(aux=[2, 16, 29])
        step = torch.compile(model, backend=taps, mode="reduce-overhead")
        step(input_ids); features = taps.taps()      # [3, B, T, H]
    """
    return TapBackend(aux, inner=inner, aux_out=aux_out, max_batch=max_batch, max_tokens=max_tokens, layers=layers,
                      aux_convention=aux_convention)


_DEFAULT: TapBackend | None = None


def default_backend() -> TapBackend:
    """The backend behind ``backend="ppsplit"``: taps from ``PPSPLIT_AUX`` (default ``eagle3``), inner backend
    ``PPSPLIT_INNER`` (default ``inductor``), buffer ``PPSPLIT_MAX_BATCH`` x ``PPSPLIT_MAX_TOKENS`` (default:
    the first call's batch and length)."""
    global _DEFAULT
    if _DEFAULT is None:
        env = os.environ

        def size(name):
            value = env.get(name)
            if value is None:
                return None
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{name} must be a positive int, but got {value!r}") from None

        _DEFAULT = TapBackend(env.get("PPSPLIT_AUX", "eagle3"), inner=env.get("PPSPLIT_INNER", "inductor"),
                              max_batch=size("PPSPLIT_MAX_BATCH"), max_tokens=size("PPSPLIT_MAX_TOKENS"))
    return _DEFAULT


def last_taps() -> torch.Tensor:
    """The taps of the last call of a model compiled with ``backend="ppsplit"``: ``[n_slots, B, T, H]``.

    Example::

        step = torch.compile(model, backend="ppsplit")
        logits = step(input_ids).logits
        features = ppsplit.last_taps()
    """
    return default_backend().taps()


def ppsplit_backend(gm: fx.GraphModule, example_inputs: list, **kwargs) -> Callable:
    """The ``torch_dynamo_backends`` entry point: ``torch.compile(model, backend="ppsplit")``."""
    return default_backend()(gm, example_inputs, **kwargs)

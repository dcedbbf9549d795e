"""Artifact: a stage's program as JSON: its FX graph, op by op, with no code and no tensors in it.

A compiled folder may come from someone else, so nothing read from it reaches Python's compiler. The graph is
rebuilt from validated parts, and the source torch.fx generates for it holds only names ppsplit made, operator
names and literals:

- node names are made by torch.fx from the resolved targets; the file's names are only keys between entries;
- placeholders are the stage contract's inputs (``INPUTS``), in order;
- a ``get_attr`` reads one of the program's declared tensors, a dotted path of identifiers (``tensor_path``);
- a call target resolves to an ATen, ppsplit or transformers operator overload, or one of a few Python operators
  on sizes; keyword names must be arguments of the operator's schema;
- argument values are checked by type (numbers, strings, dtypes, devices, slices, node references);
- a node may carry a few facts (``_META``), among them its value's static shape (``ppsplit.shape``: sizes, ``null``
  where a size varies with the step), which the stage rewrites that match shapes read where a traced graph has its
  fake values (``ppsplit.core.fx_utils.static_shape``).

The tensors come from the stage's safetensors file (``ppsplit.artifact.loader``).
"""
from __future__ import annotations

import builtins
import math
import operator
import re

import torch
from torch import fx

from ppsplit.core.checked import FolderError
from ppsplit.core.fx_utils import SHAPE, static_shape
from ppsplit.core.shards import TP_GROUP
from ppsplit.core.tensors import DTYPES, dtype_name

FORMAT = "ppsplit.stage-program"
VERSION = 2  # 2: nodes carry their static shapes (version 1 programs load, without them)
# The stage contracts: y, aux = stage(x, positions, aux) (no cache, or a lockstep cache); and a paged cache's ragged
# steps, which also take the step's metadata (ppsplit.core.ragged.STEP_INPUTS).
INPUTS = ("x", "positions", "aux", "seq", "block_table", "seq_start", "seq_count")
_CONTRACTS = (3, len(INPUTS))
_OP_NAMESPACES = ("aten", "ppsplit", "transformers", "_c10d_functional")  # the last: TP all-reduce / all-gather
_OP_NAME = re.compile(r"^(" + "|".join(_OP_NAMESPACES) + r")::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
_PY_FUNCS = {f"operator.{name}": getattr(operator, name) for name in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt", "le", "gt", "ge",
    "and_", "or_")}
_PY_FUNCS["builtins.getattr"] = builtins.getattr
_LAYOUTS = {"strided": torch.strided}
_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
            "channels_last": torch.channels_last}
_DEVICE = re.compile(r"^(cpu|cuda|meta)(:\d{1,4})?$")
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_META = {"ppsplit.tap": (int,), "ppsplit.fused": (str,), "ppsplit.layer": (int, type(None)),
         "ppsplit.vocab": (int,)}  # the last: a vocab-parallel lookup's whole vocabulary
# String arguments whose values an operator takes from a fixed set: a program may only pass one of them (ppsplit's
# norm kinds, and the ATen enumerations stages are seen to use). Other string arguments pass as literals.
_STRING_VALUES = {"kind": ("none", "rms", "rms_1p", "rms_f32w", "layer"), "approximate": ("none", "tanh"),
                  "rounding_mode": (None, "trunc", "floor"), "reduce": ("sum", "prod", "mean", "amax", "amin"),
                  "reduce_op": ("sum",), "group_name": (TP_GROUP,)}
# The collectives a TP stage calls: an all-reduce, the lm_head's all-gather, and their waits.
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "wait_tensor")
_PART = re.compile(r"^(?:[A-Za-z][A-Za-z0-9_]*|\d+)$")
_RESERVED = frozenset(dir(fx.GraphModule))  # attributes a tensor name must not shadow (forward, training, ...)


class ProgramError(FolderError):
    """A stage program that this ppsplit cannot (or will not) load."""


def tensor_path(name) -> str:
    """``name`` if it is a dotted tensor path ppsplit can hold (``model.layers.0.self_attn.q_proj.weight``: each
    part an identifier without a leading underscore, or a number, none an attribute of a module), else
    ``ProgramError``."""
    parts = name.split(".") if isinstance(name, str) and len(name) < 1000 else None
    if not parts or any(not _PART.match(p) or p in _RESERVED for p in parts):
        raise ProgramError(f"{name!r} is not a tensor name ppsplit writes (dotted identifiers and numbers)")
    return name


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    name = f"{getattr(target, '__module__', '').lstrip('_')}.{getattr(target, '__name__', '')}"
    if name not in _PY_FUNCS:
        raise ProgramError(f"cannot save a call to {target!r}: not an ATen/custom op or an allowed size operator")
    return name


def _resolve(name) -> object:
    if not isinstance(name, str):
        raise ProgramError(f"call target {name!r} is not an operator name")
    if name in _PY_FUNCS:
        return _PY_FUNCS[name]
    m = _OP_NAME.match(name)
    if m is None:
        raise ProgramError(f"the program calls {name[:80]!r}, which is not an allowed operator (namespace::name."
                           f"overload in {', '.join(_OP_NAMESPACES)}, or one of {len(_PY_FUNCS)} size operators)")
    namespace, op_name, overload = m.groups()
    if namespace == "_c10d_functional" and op_name not in _COLLECTIVES:
        raise ProgramError(f"the program calls {name[:80]!r}; of the collectives only {', '.join(_COLLECTIVES)} "
                           "are allowed")
    if namespace == "ppsplit":
        import ppsplit.triton_kernels  # noqa: F401  (registers torch.ops.ppsplit.*)
    try:
        target = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        target = None
    if not isinstance(target, torch._ops.OpOverload):
        raise ProgramError(f"operator {name} is not registered in this torch/transformers; install the versions "
                           "the folder was compiled with (see manifest.json)")
    return target


def _encode(a):
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, (list, tuple)):
        return {"list" if isinstance(a, list) else "tuple": [_encode(x) for x in a]}
    if a is None or isinstance(a, (bool, int, float, str)):
        if isinstance(a, float) and not math.isfinite(a):
            return {"float": repr(a)}
        return a
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).replace("torch.", "")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).replace("torch.", "")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if a is Ellipsis:
        return {"ellipsis": True}
    if isinstance(a, slice):
        return {"slice": [_encode(a.start), _encode(a.stop), _encode(a.step)]}
    raise ProgramError(f"cannot save an argument of type {type(a).__name__}: {a!r}")


def _decode(a, env: dict, where: str):
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        if not math.isfinite(a):
            raise ProgramError(f"{where}: a non-finite number must be written as {{\"float\": \"inf\"}}")
        return a
    if not isinstance(a, dict) or len(a) != 1:
        raise ProgramError(f"{where}: {str(a)[:60]!r} is not an argument ppsplit writes")
    (kind, value), = a.items()
    if kind == "node":
        if not isinstance(value, str) or value not in env:
            raise ProgramError(f"{where} reads node {str(value)[:60]!r}, which no earlier entry defines")
        return env[value]
    if kind in ("list", "tuple"):
        if not isinstance(value, list):
            raise ProgramError(f"{where}: a {kind} argument must hold a JSON list")
        items = [_decode(x, env, where) for x in value]
        return items if kind == "list" else tuple(items)
    table = {"float": _FLOATS, "dtype": DTYPES, "layout": _LAYOUTS, "memory_format": _FORMATS}.get(kind)
    if table is not None:
        if not isinstance(value, str) or value not in table:
            raise ProgramError(f"{where}: {kind} {str(value)[:40]!r} is not one of {', '.join(table)}")
        return table[value]
    if kind == "device":
        if not isinstance(value, str) or not _DEVICE.match(value):
            raise ProgramError(f"{where}: device {str(value)[:40]!r} is not cpu, cuda or cuda:<index>")
        return torch.device(value)
    if kind == "ellipsis" and value is True:
        return Ellipsis
    if kind == "slice" and isinstance(value, list) and len(value) == 3:
        parts = [_decode(x, env, where) for x in value]
        if not all(p is None or isinstance(p, (int, fx.Node)) and not isinstance(p, bool) for p in parts):
            raise ProgramError(f"{where}: a slice takes integers, sizes or null")
        return slice(*parts)
    raise ProgramError(f"{where}: unknown argument encoding {str(kind)[:40]!r}")


def graph_to_json(graph: fx.Graph) -> dict:
    nodes = []
    for n in graph.nodes:
        entry = {"name": n.name, "op": n.op}
        if n.op == "call_function":
            entry["target"] = _target_name(n.target)
        elif n.op in ("placeholder", "get_attr"):
            entry["target"] = n.target
        if n.args:
            entry["args"] = _encode(n.args)["tuple"]
        if n.kwargs:
            entry["kwargs"] = {k: _encode(v) for k, v in n.kwargs.items()}
        keep = {k: n.meta[k] for k in _META if k in n.meta}
        shape = static_shape(n)
        if shape is not None:
            keep[SHAPE] = list(shape)
        if keep:
            entry["meta"] = keep
        nodes.append(entry)
    return {"format": FORMAT, "version": VERSION, "nodes": nodes}


def graph_from_json(data, tensors) -> fx.Graph:
    """The graph of a program ``data`` (``graph_to_json``'s output, as read from a file) whose ``get_attr`` nodes
    read only the tensor names in ``tensors``; every part validated (see the module docstring)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProgramError(f"not a ppsplit stage program (format {str(data.get('format') if isinstance(data, dict) else data)[:40]!r})")
    version = data.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION:
        raise ProgramError(f"stage program version {version!r} is newer than this ppsplit reads ({VERSION}); "
                           "upgrade ppsplit")
    entries = data.get("nodes")
    if not isinstance(entries, list) or not entries:
        raise ProgramError("the program has no list of nodes")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs, ended = 0, False
    for i, entry in enumerate(entries):
        where = f"nodes[{i}]"
        if not isinstance(entry, dict) or not set(entry) <= {"name", "op", "target", "args", "kwargs", "meta"}:
            raise ProgramError(f"{where} is not a node entry ppsplit writes")
        key, op = entry.get("name"), entry.get("op")
        if not isinstance(key, str) or key in env:
            raise ProgramError(f"{where}: node name {str(key)[:40]!r} is missing or repeats an earlier one")
        if ended:
            raise ProgramError(f"{where} comes after the output")
        args, kwargs = entry.get("args", []), entry.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ProgramError(f"{where}: args must be a list and kwargs an object")
        args = tuple(_decode(a, env, f"{where}.args") for a in args)
        if op == "placeholder":
            if inputs >= len(INPUTS) or entry.get("target") != INPUTS[inputs] or args or kwargs or len(graph.nodes) > inputs:
                raise ProgramError(f"{where}: the program's inputs must be {', '.join(INPUTS[:3])} (and for ragged "
                                   f"steps {', '.join(INPUTS[3:])}), first and in order")
            node = graph.placeholder(INPUTS[inputs])
            inputs += 1
        elif op == "get_attr":
            target = entry.get("target")
            if target not in tensors or args or kwargs:
                raise ProgramError(f"{where} reads {str(target)[:80]!r}, which is not one of the stage's tensors")
            node = graph.create_node("get_attr", tensor_path(target))
        elif op == "call_function":
            target = _resolve(entry.get("target"))
            node = graph.call_function(target, args, _kwargs(target, kwargs, env, where))
            _check_call(target, node, where)
        elif op == "output":
            if len(args) != 1 or kwargs or inputs not in _CONTRACTS:
                raise ProgramError(f"{where}: the output takes one value, after the inputs {', '.join(INPUTS[:3])} "
                                   f"(and for ragged steps {', '.join(INPUTS[3:])})")
            node = graph.output(args[0])
            ended = True
        else:
            raise ProgramError(f"{where}: unsupported node kind {str(op)[:40]!r}")
        node.meta.update(_meta(entry.get("meta", {}), where))
        env[key] = node
    if not ended:
        raise ProgramError("the program has no output")
    try:
        graph.lint()
    except Exception as e:  # an inconsistent graph: a ProgramError with fx's reason
        raise ProgramError(f"the program's graph is inconsistent ({str(e).splitlines()[0][:200]})") from None
    return graph


def _kwargs(target, kwargs: dict, env: dict, where: str) -> dict:
    schema = getattr(target, "_schema", None)
    names = {a.name for a in schema.arguments} if schema is not None else set()
    for name in kwargs:
        if name not in names:
            raise ProgramError(f"{where}: keyword {str(name)[:40]!r} is not an argument of {_target_name(target)}")
    return {k: _decode(v, env, f"{where}.kwargs.{k}") for k, v in kwargs.items()}


def _check_call(target, node: fx.Node, where: str) -> None:
    schema = getattr(target, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            allowed = _STRING_VALUES.get(arg.name)
            if isinstance(value, str) and allowed is not None and value not in allowed:
                raise ProgramError(f"{where}: {_target_name(target)} argument {arg.name} = {value[:40]!r} is not one "
                                   f"of {', '.join(map(str, allowed))}")
        return
    if target is builtins.getattr:
        if len(node.args) != 2 or not isinstance(node.args[0], fx.Node) or node.args[1] != "device":
            raise ProgramError(f"{where} reads attribute {node.args[1:]!r}; only a tensor's device is allowed")
    elif target in _PY_FUNCS.values():
        if node.kwargs or not 1 <= len(node.args) <= 2 or not all(
                isinstance(a, (fx.Node, int, float)) for a in node.args):
            raise ProgramError(f"{where}: {_target_name(target)} takes one or two sizes or numbers")


def _meta(meta, where: str) -> dict:
    if not isinstance(meta, dict):
        raise ProgramError(f"{where}.meta must be an object")
    for key, value in meta.items():
        if key == SHAPE:
            if not isinstance(value, list) or len(value) > 16 or not all(
                    d is None or isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2 ** 48 for d in value):
                raise ProgramError(f"{where}.meta: {SHAPE} = {str(value)[:40]!r} is not a list of sizes or nulls")
            meta[key] = tuple(value)
            continue
        kinds = _META.get(key)
        if kinds is None or not isinstance(value, kinds) or isinstance(value, bool):
            raise ProgramError(f"{where}.meta: {str(key)[:40]!r} = {str(value)[:40]!r} is not a fact ppsplit writes")
    return meta

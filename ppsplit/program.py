"""Driver support: a stage's program as JSON: its FX graph, op by op, with no code and no tensors in it.

Loading resolves every call target against an allowlist (ATen, ppsplit's and transformers' custom ops, a few
Python operators on sizes), so a compiled folder from someone else cannot run code of its choosing; the
tensors come from the stage's safetensors file.
"""
from __future__ import annotations

import builtins
import operator

import torch
from torch import fx

from ppsplit.tensors import DTYPES, dtype_name

FORMAT = "ppsplit.stage-program"
VERSION = 1
_OP_NAMESPACES = {"aten", "ppsplit", "transformers"}
_PY_FUNCS = {f"operator.{name}": getattr(operator, name) for name in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt", "le", "gt", "ge",
    "and_", "or_")}
_PY_FUNCS["builtins.getattr"] = builtins.getattr
_LAYOUTS = {"strided": torch.strided}
_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
            "channels_last": torch.channels_last}


class ProgramError(ValueError):
    """A stage program that this ppsplit cannot (or will not) load."""


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    name = f"{getattr(target, '__module__', '').lstrip('_')}.{getattr(target, '__name__', '')}"
    if name not in _PY_FUNCS:
        raise ProgramError(f"cannot save a call to {target!r}: not an ATen/custom op or an allowed size operator")
    return name


def _resolve(name: str):
    if name in _PY_FUNCS:
        return _PY_FUNCS[name]
    if "::" not in name:
        raise ProgramError(f"the program calls {name!r}, which is not an allowed operator")
    namespace, rest = name.split("::", 1)
    if namespace not in _OP_NAMESPACES:
        raise ProgramError(f"the program calls {name!r} from namespace {namespace!r}; allowed: "
                           f"{', '.join(sorted(_OP_NAMESPACES))}")
    op_name, overload = rest.rsplit(".", 1)
    if namespace == "ppsplit":
        import ppsplit.triton_kernels  # noqa: F401  (registers torch.ops.ppsplit.*)
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        raise ProgramError(f"operator {name} is not registered in this torch/transformers; install the versions "
                           "the folder was compiled with (see manifest.json)") from None


def _encode(a):
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, (list, tuple)):
        return {"list" if isinstance(a, list) else "tuple": [_encode(x) for x in a]}
    if a is None or isinstance(a, (bool, int, float, str)):
        if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
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


def _decode(a, env: dict):
    if not isinstance(a, dict):
        return a
    (kind, value), = a.items()
    if kind == "node":
        return env[value]
    if kind in ("list", "tuple"):
        items = [_decode(x, env) for x in value]
        return items if kind == "list" else tuple(items)
    if kind == "float":
        return float(value)
    if kind == "dtype":
        return DTYPES[value]
    if kind == "layout":
        return _LAYOUTS[value]
    if kind == "memory_format":
        return _FORMATS[value]
    if kind == "device":
        return torch.device(value)
    if kind == "ellipsis":
        return Ellipsis
    if kind == "slice":
        return slice(*(_decode(x, env) for x in value))
    raise ProgramError(f"unknown argument encoding {kind!r}")


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
        keep = {k: n.meta[k] for k in ("ppsplit.tap", "ppsplit.fused", "ppsplit.layer") if k in n.meta}
        if keep:
            entry["meta"] = keep
        nodes.append(entry)
    return {"format": FORMAT, "version": VERSION, "nodes": nodes}


def graph_from_json(data: dict) -> fx.Graph:
    if data.get("format") != FORMAT:
        raise ProgramError(f"not a ppsplit stage program (format {data.get('format')!r})")
    if data.get("version", 0) > VERSION:
        raise ProgramError(f"stage program version {data['version']} is newer than this ppsplit reads ({VERSION}); "
                           "upgrade ppsplit")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for entry in data["nodes"]:
        op, name = entry["op"], entry["name"]
        args = tuple(_decode(a, env) for a in entry.get("args", ()))
        kwargs = {k: _decode(v, env) for k, v in entry.get("kwargs", {}).items()}
        if op == "placeholder":
            node = graph.placeholder(entry["target"])
        elif op == "get_attr":
            node = graph.create_node("get_attr", entry["target"])
        elif op == "call_function":
            target = _resolve(entry["target"])
            if target is builtins.getattr and (len(args) != 2 or args[1] != "device"):
                raise ProgramError(f"the program reads attribute {args[1:]!r}; only a tensor's device is allowed")
            node = graph.call_function(target, args, kwargs)
        elif op == "output":
            node = graph.output(args[0])
        else:
            raise ProgramError(f"unsupported node kind {op!r}")
        node.name = name
        node.meta.update(entry.get("meta", {}))
        env[name] = node
    graph.lint()
    return graph

"""Which model line made ``torch.export`` pin a size that must stay dynamic.

A model that branches in Python on the token count (``if x.shape[1] > 0:``, a window count that must be 2) gets a
graph that is only valid for the sizes that take the same branches: export narrows the token range (and, with
named dims, fails with a message that names no line, or crashes describing it). The guards export records while
tracing carry no model line for such branches, so the export is repeated with torch's shape-guard log on, and the
Python stack of each new guard gives the first frame outside torch and ppsplit: the model's line.
"""
from __future__ import annotations

import contextlib
import logging
import re
import traceback

import torch

_GUARD_LOG = "torch.fx.experimental.symbolic_shapes"


class _GuardStacks(logging.Handler):
    """Keeps, per guard expression (as torch logs it), the first model-code frame on the stack when it was added."""

    def __init__(self, is_library_file):
        super().__init__(logging.INFO)
        self.is_library_file = is_library_file
        self.lines: dict[str, traceback.FrameSummary] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if "[guard added]" not in str(record.msg) or not record.args or len(record.args) < 2:
            return
        expr = str(record.args[1])
        if expr in self.lines:
            return
        for frame in reversed(traceback.extract_stack()):
            if not self.is_library_file(frame.filename) and "/logging/" not in frame.filename:
                self.lines[expr] = frame
                return


@contextlib.contextmanager
def guard_stacks(is_library_file):
    """Record the model line behind every shape guard added inside the block (``handler.lines``)."""
    logger = logging.getLogger(_GUARD_LOG)
    handler = _GuardStacks(is_library_file)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # keep the INFO lines off the user's stderr
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def narrowed_sizes(ep: torch.export.ExportedProgram, wanted: dict[int, int | None]) -> dict[int, tuple[int, int]]:
    """``{dim of input_ids: (lo, hi)}`` for each dynamic dim whose range export narrowed below ``[2, wanted max]``
    (torch assumes sizes of at least 2 while tracing; 0 and 1 still run)."""
    ids = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    out = {}
    for dim, maximum in wanted.items():
        size = ids.meta["val"].shape[dim]
        if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
            if dim == 1:  # a token count fixed to the example's; a batch fixed to the cache's rows still runs
                out[dim] = (int(size), int(size))
            continue
        vr = ep.range_constraints.get(size.node.expr)
        if vr is None:
            continue
        lo, hi = _int(vr.lower), _int(vr.upper)
        if (lo is not None and lo > 2) or (hi is not None and (maximum is None or hi < maximum)):
            out[dim] = (lo, hi)
    return out


def blame(ep: torch.export.ExportedProgram, stacks: dict[str, traceback.FrameSummary], dim: int,
          maximum: int | None) -> traceback.FrameSummary | None:
    """The model line of the first guard that fails for some size of ``input_ids`` dim ``dim`` in
    ``[2, maximum]`` (sampled up to 512), other sizes held at the traced example's."""
    ids = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    size = ids.meta["val"].shape[dim]
    shape_env = ids.meta["val"].fake_mode.shape_env
    symbol = size.node.expr
    hints = getattr(shape_env, "backed_var_to_val", None)
    hints = shape_env.var_to_val if hints is None else hints
    top = min(maximum or 512, 512)
    powers = [2 ** k + d for k in range(1, 10) for d in (-1, 0, 1)]
    values = sorted({v for v in [*range(2, 65), *powers, top] if 2 <= v <= top})
    restricting = []
    for guard in shape_env.guards:
        expr = shape_env.replace(guard.expr)
        frame = stacks.get(str(guard.expr))
        if symbol not in expr.free_symbols or frame is None:
            continue
        fixed = expr.subs({s: hints[s] for s in expr.free_symbols if s != symbol and s in hints})
        for value in values:
            try:
                holds = bool(fixed.subs(symbol, value))
            except TypeError:  # not decidable by substitution (other free symbols): not this guard
                break
            if not holds:
                restricting.append((guard, frame))
                break
    # Prefer a guard torch itself located in the model's code (a Python branch on the size) over one raised inside
    # torch on the model's behalf (a view that is valid only for some sizes).
    for guard, frame in restricting:
        if f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" in str(getattr(guard, "sloc", "")):
            return frame
    return restricting[0][1] if restricting else None


def blame_fixed(stacks: dict[str, traceback.FrameSummary], size: int) -> traceback.FrameSummary | None:
    """The model line of the guard that fixed a size to the traced example's ``size`` (``Eq(s70, 8)``: Python that
    turns the size into an int, as ``range(seq_len)`` does)."""
    fixed = re.compile(rf"Eq\((s\d+), {size}\)|Eq\({size}, (s\d+)\)")
    return next((frame for expr, frame in stacks.items() if fixed.fullmatch(expr)), None)


def _int(bound) -> int | None:
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):  # sympy / torch infinities
        return None

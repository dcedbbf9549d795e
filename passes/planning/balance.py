"""Plan helper: the exact contiguous split that minimises the slowest stage, optionally under a memory cap.

Stages are contiguous runs of layers, each non-empty; stage 0 also pays the embedding, the last stage the head,
every stage a fixed per-stage cost. Dynamic programming over (stage, layers covered) finds the smallest possible
largest stage cost in O(pp * L^2); a second pass picks, among the splits that reach it, the one with the smallest
sum of squared stage costs (the most even), so ties are resolved the same way every time.
"""
from __future__ import annotations

from ppsplit.core.errors import ConfigError
from ppsplit.core.plan import RegionCosts, fmt_bytes

_INF = float("inf")


def best_split(cost: RegionCosts, pp: int, *, memory: RegionCosts | None = None,
               cap: float | None = None) -> list[int] | None:
    """Layers per stage minimising the largest ``cost`` of a stage, with every stage's ``memory`` at most ``cap``;
    ``None`` when no split fits the cap.

    Example::

        best_split(RegionCosts(layers=(1.0,) * 8, head=2.0), 3)   # [3, 3, 2]
    """
    n = len(cost.layers)
    if not 1 <= pp <= n:
        raise ValueError(f"cannot split {n} layers into {pp} non-empty stages")
    part = _part_cost(cost, pp)
    mem = _part_cost(memory, pp) if cap is not None and memory is not None else None
    bounds = _min_max_bounds(part, mem, cap, n, pp)
    return None if bounds is None else [j - i for i, j in zip(bounds, bounds[1:])]


def smallest_cap(memory: RegionCosts, pp: int) -> float:
    """The smallest per-stage ``memory`` cap under which some split into ``pp`` stages fits."""
    return max(memory.stage_costs(best_split(memory, pp)))


def _part_cost(costs: RegionCosts, pp: int):
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def part(k: int, i: int, j: int) -> float:
        # Always computed the same way, so equal splits compare equal in floating point.
        return (prefix[j] - prefix[i] + costs.stage + (costs.embed if k == 0 else 0.0)
                + (costs.head if k == pp - 1 else 0.0))
    return part


def best_bounds(cost: RegionCosts, pp: int, cuts, *, memory: RegionCosts | None = None,
                cap: float | None = None) -> list[int] | None:
    """``best_split`` in half layers: stage boundaries in half-layer positions (``2j`` is the start of layer ``j``,
    ``2j + 1`` its middle), chosen among ``cuts`` (which holds ``0`` and ``2L``), minimising the largest ``cost`` of
    a stage, then the sum of squares; ``cost.attention`` gives each layer's attention half. ``None`` when no split
    fits the cap.

    Example::

        best_bounds(RegionCosts(layers=(2.0,) * 4, attention=(1.0,) * 4, head=3.0), 2, range(9))   # [0, 5, 8]
    """
    points = sorted(set(cuts))
    n = len(points) - 1
    if not 1 <= pp <= n:
        raise ValueError(f"cannot split {n} units into {pp} non-empty stages")
    part = _span_cost(cost, pp, points)
    mem = _span_cost(memory, pp, points) if cap is not None and memory is not None else None
    bounds = _min_max_bounds(part, mem, cap, n, pp)
    return None if bounds is None else [points[i] for i in bounds]


def _min_max_bounds(part, mem, cap, n: int, pp: int) -> list[int] | None:
    """The boundaries ``[0, ..., n]`` of ``pp`` contiguous non-empty stages over ``n`` units minimising the largest
    ``part(k, i, j)`` (stage ``k`` covering units ``[i, j)``), then the sum of squares, with ``mem(k, i, j) <= cap``
    when ``mem`` is given; ``None`` when no split fits."""
    def fits(k, i, j):
        return mem is None or mem(k, i, j) <= cap

    # best[k][j]: the smallest possible largest stage when stages 0..k cover units [0, j).
    best = [[_INF] * (n + 1) for _ in range(pp)]
    for j in range(1, n - pp + 2):
        if fits(0, 0, j):
            best[0][j] = part(0, 0, j)
    for k in range(1, pp):
        for j in range(k + 1, n - pp + k + 2):
            best[k][j] = min((max(best[k - 1][i], part(k, i, j)) for i in range(k, j) if fits(k, i, j)),
                             default=_INF)
    bound = best[pp - 1][n]
    if bound == _INF:
        return None

    # Among the splits whose stages all stay within the bound, the most even one.
    sq = [[_INF] * (n + 1) for _ in range(pp)]
    choice = [[0] * (n + 1) for _ in range(pp)]
    for j in range(1, n - pp + 2):
        if part(0, 0, j) <= bound and fits(0, 0, j):
            sq[0][j] = part(0, 0, j) ** 2
    for k in range(1, pp):
        for j in range(k + 1, n - pp + k + 2):
            for i in range(k, j):
                c = part(k, i, j)
                if c <= bound and fits(k, i, j) and sq[k - 1][i] + c * c < sq[k][j]:
                    sq[k][j], choice[k][j] = sq[k - 1][i] + c * c, i
    out = [n]
    for k in range(pp - 1, 0, -1):
        out.append(choice[k][out[-1]])
    out.append(0)
    return out[::-1]


def _span_cost(costs: RegionCosts, pp: int, points: list[int]):
    prefix = [0.0]
    for j, c in enumerate(costs.layers):
        prefix += [prefix[-1] + (costs.attention[j] if costs.attention else 0.0), prefix[-1] + c]
    at = [prefix[p] for p in points]

    def part(k: int, i: int, j: int) -> float:
        return (at[j] - at[i] + costs.stage + (costs.embed if k == 0 else 0.0)
                + (costs.head if k == pp - 1 else 0.0))
    return part


def given_sizes(balance, costs, pp: int) -> tuple[str, list]:
    """``(name, layer counts)`` of a balance given as a function ``f(costs, pp)`` or as explicit counts."""
    if callable(balance):
        return getattr(balance, "__name__", "custom"), list(balance(costs, pp))
    return "explicit", list(balance)


def no_split_under_cap(num_layers: int, pp: int, cap: int, need: float, unit: str = "layers") -> ConfigError:
    """The error when no split of ``num_layers`` into ``pp`` stages fits ``max_stage_bytes=cap``; ``need`` is the
    smallest cap that would."""
    return ConfigError(f"no split of the {num_layers} {unit} into {pp} stages keeps every stage within "
                       f"max_stage_bytes={cap} ({fmt_bytes(cap)}, weights + KV cache); the smallest cap that fits "
                       f"pp={pp} is {int(need)} ({fmt_bytes(need)}): raise max_stage_bytes, use more stages, or a "
                       "smaller KV cache")

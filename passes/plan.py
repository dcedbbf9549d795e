"""Pass 3, plan: pure data. Choose stage ranges with a balancing policy and place the taps.

A policy maps ``(ModelCosts, pp)`` to the number of layers per stage. Built in:

- ``"layers"``: as many layers per stage as possible, evenly; the first and last stages, which also hold the
  embedding and the head, take the smaller shares when the layers do not divide evenly.
- ``"params"``: minimise the largest stage by parameter count, embedding and head included.

Any callable with that signature, or an explicit list of layer counts, plugs in the same way.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ppsplit.config import Balance
from ppsplit.errors import ConfigError
from ppsplit.passes.annotate import Annotated
from ppsplit.plan import ModelCosts, SplitPlan, StagePlan
from ppsplit.tensors import dtype_name

BalancePolicy = Callable[[ModelCosts, int], Sequence[int]]


def balance_layers(costs: ModelCosts, pp: int) -> list[int]:
    # Whole layers dominate; the embedding and head only break ties, so uneven counts leave the end stages lighter.
    layer = [1000] * costs.num_layers
    return _min_max_partition(layer, pp, first_extra=1, last_extra=1)


def balance_params(costs: ModelCosts, pp: int) -> list[int]:
    return _min_max_partition(list(costs.layer_params), pp, first_extra=costs.embed_params, last_extra=costs.head_params)


POLICIES: dict[str, BalancePolicy] = {"layers": balance_layers, "params": balance_params}


def make_plan(costs: ModelCosts, pp: int, taps: Sequence[int] = (), *, balance: Balance = "layers",
              hidden_size: int = 0, dtype: str = "", model_class: str = "", layers_fqn: str = "",
              max_batch: int = 0, max_len: int = 0) -> SplitPlan:
    """Compute a ``SplitPlan`` for ``pp`` stages and the given tap ids (vLLM numbering, duplicates collapse).
    ``pp`` and ``taps`` are expected valid (``SplitOptions.taps`` checks them against the model).

    Example::

        make_plan(costs, pp=4, taps=(2, 16, 29), balance="params")
    """
    num_layers = costs.num_layers
    slots = tuple(sorted(set(int(t) for t in taps)))

    if isinstance(balance, str):
        if balance not in POLICIES:
            raise ConfigError(f"balance must be one of {', '.join(POLICIES)} (or a list of layer counts), "
                              f"but got {balance!r}")
        name, sizes = balance, POLICIES[balance](costs, pp)
    elif callable(balance):
        name, sizes = getattr(balance, "__name__", "custom"), balance(costs, pp)
    else:
        name, sizes = "explicit", balance
    sizes = [int(n) for n in sizes]
    if len(sizes) != pp or any(n < 1 for n in sizes) or sum(sizes) != num_layers:
        raise ConfigError(f"balance gave layer counts {sizes}; they must be {pp} positive numbers that add up to "
                          f"the model's {num_layers} decoder layers")

    stages = []
    start = 0
    for i, n in enumerate(sizes):
        end = start + n
        params = sum(costs.layer_params[start:end])
        nbytes = sum(costs.layer_bytes[start:end]) if costs.layer_bytes else 0
        if i == 0:
            params, nbytes = params + costs.embed_params, nbytes + costs.embed_bytes
        if i == pp - 1:
            params, nbytes = params + costs.head_params, nbytes + costs.head_bytes
        cost = float(n) if name == "layers" else float(params)
        cache = sum(costs.layer_cache_bytes[start:end]) if costs.layer_cache_bytes else 0
        stages.append(StagePlan(index=i, start=start, end=end, cost=cost, params=params, bytes=nbytes,
                                cache_bytes=cache))
        start = end
    return SplitPlan(num_layers=num_layers, hidden_size=hidden_size, dtype=dtype, stages=tuple(stages), taps=slots,
                     balance=name, model_class=model_class, layers_fqn=layers_fqn, costs=costs,
                     max_batch=max_batch, max_len=max_len)


def plan(annotated: Annotated, pp: int, taps: Sequence[int] = (), *, balance: Balance = "layers") -> SplitPlan:
    """``make_plan`` with the costs, sizes and names that the trace and annotate passes found."""
    gm = annotated.gm
    cut0 = gm.graph.find_nodes(op="placeholder", target="input_ids")[0]
    hidden = next(n for n in gm.graph.nodes if n.name in annotated.cuts[0])
    if hidden is cut0:
        raise ConfigError("the traced graph feeds input_ids straight into layer 0; ppsplit needs an embedding")
    val = hidden.meta["val"]
    cache = annotated.traced.cache
    return make_plan(annotated.costs, pp, taps, balance=balance, hidden_size=int(val.shape[-1]),
                     dtype=dtype_name(val.dtype), model_class=annotated.traced.model_class,
                     layers_fqn=annotated.layers.fqn, max_batch=cache.batch_size if cache else 0,
                     max_len=cache.max_len if cache else 0)


def _min_max_partition(costs: list[int], pp: int, first_extra: int, last_extra: int) -> list[int]:
    """Contiguous split of ``costs`` into ``pp`` non-empty parts minimising the largest part (extras added to
    the first and last parts); among those, the one with the smallest sum of squares."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def part(k: int, i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (first_extra if k == 0 else 0) + (last_extra if k == pp - 1 else 0)

    inf = float("inf")
    # best[k][j]: smallest possible largest part when parts 0..k cover costs[:j].
    best = [[inf] * (n + 1) for _ in range(pp)]
    for j in range(1, n - pp + 2):
        best[0][j] = part(0, 0, j)
    for k in range(1, pp):
        for j in range(k + 1, n - pp + k + 2):
            best[k][j] = min(max(best[k - 1][i], part(k, i, j)) for i in range(k, j))
    bound = best[pp - 1][n]

    # Second pass: among splits whose parts all fit under the bound, the most even one.
    sq = [[inf] * (n + 1) for _ in range(pp)]
    choice = [[0] * (n + 1) for _ in range(pp)]
    for j in range(1, n - pp + 2):
        if part(0, 0, j) <= bound:
            sq[0][j] = part(0, 0, j) ** 2
    for k in range(1, pp):
        for j in range(k + 1, n - pp + k + 2):
            for i in range(k, j):
                c = part(k, i, j)
                if c <= bound and sq[k - 1][i] + c * c < sq[k][j]:
                    sq[k][j], choice[k][j] = sq[k - 1][i] + c * c, i
    sizes = []
    j = n
    for k in range(pp - 1, 0, -1):
        i = choice[k][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]

"""``ppsplit::cache_write``: a cache write as one op that mutates the cache buffer it names.

The traced graphs write the cache as ``cache[:B].index_copy_(dim, positions, value)``: an in-place op on a view.
Under ``torch.compile`` that becomes an out-of-place copy of the whole buffer and a copy back at the end of the
graph (Inductor did not re-inplace it: at batch 32, Llama-3.1-8B's K and V copies were 40% of a compiled decode
step on an H200). ``ppsplit.passes.rewrites.inductor.compile_stage`` rewrites each such write into this op, which Inductor keeps
in place, before compiling. The math is the same ``index_copy_``, on every device.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("ppsplit::cache_write", mutates_args=("cache",))
def cache_write(cache: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, dim: int) -> None:
    """``cache[:value.shape[0]].index_copy_(dim, positions, value)``."""
    cache[:value.shape[0]].index_copy_(dim, positions, value)


@cache_write.register_fake
def _(cache, value, positions, dim):
    return None

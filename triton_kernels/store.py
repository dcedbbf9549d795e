"""``ppsplit::tap_store(aux, slot, value)``: ``aux[slot] = value``, the store of one tap into its slot."""
from __future__ import annotations

import torch


@torch.library.custom_op("ppsplit::tap_store", mutates_args=("aux",))
def tap_store(aux: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    """Write ``value`` ``[B, T, H]`` into slot ``slot`` of the packed buffer ``aux`` ``[n_slots, B, T, H]``."""
    aux[slot].copy_(value)


@tap_store.register_fake
def _(aux: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    return None

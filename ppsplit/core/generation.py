"""Core: Hugging Face's greedy end-of-sequence rule, in one place for every decoding loop.

``generate(do_sample=False)`` keeps a batch going until every sequence has emitted an end-of-sequence token; a
sequence that has ended continues with padding (``pad_token_id``, else the first end-of-sequence id).
"""
from __future__ import annotations

import torch


class EndOfSequence:
    """The rule for one batch on one device.

    Example::

        eos = EndOfSequence((2,), pad_token_id=0, device="cpu")
        done = eos.new_done(batch)
        token = eos.apply(logits[:, -1].argmax(-1), done)   # ended sequences get padding; done is updated
    """

    def __init__(self, eos_token_id=(), pad_token_id: int | None = None, device="cpu"):
        ids = tuple(eos_token_id)
        self.ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.pad = pad_token_id if pad_token_id is not None else (ids or (0,))[0]

    def __bool__(self) -> bool:
        return len(self.ids) > 0

    def new_done(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, dtype=torch.bool, device=self.ids.device)

    def apply(self, token: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """``token`` with padding where the sequence had ended; marks the sequences that end now in ``done``."""
        if not self:
            return token
        token = torch.where(done, torch.full_like(token, self.pad), token)
        done |= torch.isin(token, self.ids)
        return token

    def all_done(self, done: torch.Tensor) -> bool:
        """Whether every sequence has ended (one host read)."""
        return bool(self) and bool(done.all())

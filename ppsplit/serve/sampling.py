"""Serving: per-request sampling parameters, and the filtered distribution a request samples from.

Every request draws from its own ``torch.Generator`` (seeded by ``SamplingParams.seed``), so the same seed gives
the same tokens whatever the batch companions are. Greedy (``temperature`` below ``GREEDY_BELOW``, vLLM's epsilon:
dividing by less overflows the logits) is the argmax; otherwise the
logits are divided by the temperature, cut to the ``top_k`` largest and then to the smallest set whose
probability reaches ``top_p`` (the order vLLM and Hugging Face apply them), renormalised, and sampled with the
exponential race (no host synchronisation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppsplit.core.errors import ConfigError

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. ``max_tokens``: new tokens at most; ``stop_token_ids``: end the output (the token is
    kept, as an end-of-sequence token is); ``ignore_eos``: keep going past the model's end-of-sequence ids.

    Example::

        SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=7)
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, but got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature <= 100:
            raise ConfigError(f"temperature must be a number from 0 (greedy) to 100, but got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be a number in (0, 1], but got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0: no cut), but got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigError(f"seed must be an integer or None, but got {self.seed!r}")
        stop = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop):
            raise ConfigError(f"stop_token_ids must be token ids (integers >= 0), but got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``[..., V]`` (float32) a request samples from: temperature, then top-k, then top-p."""
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        keep = before < params.top_p  # the smallest set reaching top_p (the top token always stays)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One id per row of ``probs [..., V]`` by the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``: exact, and
    without a host synchronisation (unlike ``multinomial``)."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / race).argmax(-1)


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The next token from ``logits [..., V]``: the argmax when greedy, else a sample of ``filtered_probs``."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(filtered_probs(logits, params), generator)

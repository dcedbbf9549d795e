"""Serving: per-request sampling parameters, and the batched device ops every request of a step samples with.

Greedy (``temperature`` below ``GREEDY_BELOW``) is the argmax. Otherwise the logits are divided by the temperature,
cut to the ``top_k`` largest and then to the smallest set whose probability reaches ``top_p`` (the order vLLM and
Hugging Face apply them), renormalised, and drawn by inverting the cumulative distribution at one uniform number.

Randomness is counter-based: the uniform a request draws with is a hash of its seed, the output index of the token
being drawn and what it is drawn for (``SALT_*``), computed with tensor ops on the device for every request of a step
at once. So the same seed gives the same tokens whatever the batch companions are, and no draw reads the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppsplit.core.errors import ConfigError

GREEDY_BELOW = 1e-5  # as vLLM: a smaller temperature decodes greedily (dividing by it would overflow to inf)
SALT_TARGET, SALT_ACCEPT, SALT_DRAFT = 0, 1, 2  # a target draw, a draft's acceptance test, a drafter's draw


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
    """The distribution ``[..., V]`` (float32) one request samples from: temperature, then top-k, then top-p. The
    per-request reference of ``filter_batch``."""
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


def filter_batch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
                 cut_k: bool = True, cut_p: bool = True) -> torch.Tensor:
    """``filtered_probs`` for every row at once: ``logits [R, J, V]``, one ``temperature``, ``top_k`` (0: no cut)
    and ``top_p`` per row ``[R]``; float32 ``[R, J, V]``. ``cut_k`` / ``cut_p`` False (no row cuts): skip the sort."""
    scores = logits.float() / temperature.clamp_min(GREEDY_BELOW)[:, None, None]
    width = scores.shape[-1]
    ordered = None
    if cut_k:
        ordered = torch.sort(scores, dim=-1, descending=True).values
        k = top_k.clamp(0, width)[:, None, None]
        kth = ordered.gather(-1, (k - 1).clamp_min(0).expand(*scores.shape[:2], 1))
        scores = scores.masked_fill((k > 0) & (scores < kth), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cut_p:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        keep = before < top_p[:, None, None]
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (avalanching) on int64 lanes holding values below 2**32; products stay below 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, index: torch.Tensor, salt: int) -> torch.Tensor:
    """A float32 uniform in (0, 1) per element of ``index`` (int64), a function of ``(seed, index, salt)`` only;
    ``seed`` broadcasts against ``index``."""
    seed = seed.long()
    h = _mix((index.long() & _M32) ^ _mix(torch.full_like(index.long(), salt + 0x9E3779B9 & _M32)))
    h = _mix(((seed >> 32) & _M32) ^ h)
    h = _mix((seed & _M32) ^ h)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One id per row of ``probs [..., V]`` (unnormalised is fine): the inverse of the cumulative distribution at
    ``u [...]``. A zero-probability id is never drawn."""
    cdf = probs.float().cumsum(-1)
    at = (u * cdf[..., -1])[..., None]
    ids = torch.searchsorted(cdf, at, right=True)[..., 0]
    # u * total can round up to the total itself: then the largest probability stands in (odds ~1e-7).
    return torch.where(ids < probs.shape[-1], ids, probs.argmax(-1))


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor):
    """The greedy rule, per row: ``target [R, K + 1]`` the target's argmax ids at the last known token and at each
    draft, ``drafts [R, K]`` (entries at or past ``num_drafts [R]`` are ignored). Returns ``(n [R], token [R])``: the
    drafts accepted (the longest prefix equal to the target's ids) and the target's id after them."""
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device) < num_drafts[:, None]
    n = torch.cumprod(((target[:, :k] == drafts) & valid).long(), dim=1).sum(1)
    return n, target.gather(1, n[:, None])[:, 0]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                   u_accept: torch.Tensor, u_draw_of):
    """The rejection rule of Leviathan et al. / Chen et al., per row: ``p [R, K + 1, V]`` the target's filtered
    distributions, ``q [R, K, V]`` the drafter's (over the target vocabulary), ``drafts [R, K]`` (the first
    ``num_drafts [R]`` are real), ``u_accept [R, K]`` uniforms. Draft ``d`` is accepted with probability
    ``min(1, p(d) / q(d))``; at the first rejection the token is drawn from ``norm(max(0, p - q))``, after every
    draft from ``p``. ``u_draw_of(n)``: the uniform ``[R]`` the token after ``n`` acceptances is drawn with.
    Returns ``(n [R], token [R])``; every committed token is distributed as ``p``."""
    rows, k = drafts.shape
    valid = torch.arange(k, device=drafts.device) < num_drafts[:, None]
    safe = drafts.clamp_min(0)[..., None]
    p_d = p[:, :k].gather(2, safe)[..., 0]
    q_d = q.gather(2, safe)[..., 0]
    n = torch.cumprod(((u_accept * q_d < p_d) & valid).long(), dim=1).sum(1)
    at = n[:, None, None].expand(rows, 1, p.shape[-1])
    p_n = p.gather(1, at)[:, 0]
    q_n = torch.cat([q, q.new_zeros(rows, 1, q.shape[-1])], 1).gather(1, at)[:, 0]
    rejected = (n < num_drafts)[:, None]
    residual = torch.where(rejected, (p_n - q_n).clamp_min(0), p_n)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)  # p == q up to rounding
    return n, draw(residual, u_draw_of(n))

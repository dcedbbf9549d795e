"""Serving: per-request sampling parameters, and the batched device ops every request of a step samples with.

Greedy (``temperature`` below ``GREEDY_BELOW``) is the argmax. Otherwise the logits are divided by the temperature,
cut to the ``top_k`` largest and then to the smallest set whose probability reaches ``top_p`` (the order vLLM and
Hugging Face apply them), renormalised, and drawn by inverting the cumulative distribution at one uniform number.

Before that, a request's logits are adjusted (``adjusted_logits``, the per-request reference): ``logit_bias`` added,
its stop ids (end-of-sequence and ``stop_token_ids``) masked while fewer than ``min_tokens`` are out, then the
penalties as vLLM defines them (``vllm/model_executor/layers/utils.py: apply_penalties``): ``repetition_penalty``
divides a positive logit (multiplies a negative one) of every token seen in the prompt or the output, and
``frequency_penalty * count + presence_penalty * (count > 0)`` is subtracted, ``count`` being the token's occurrences
in the output so far (OpenAI's definition). The target distribution that greedy, sampling and the rejection rule use
is the adjusted one; ``logprobs`` are the unadjusted model's (``log_softmax`` of the logits, as vLLM's default), or
with ``logprobs_adjusted`` the adjusted logits' (vLLM's processed logprobs, before the temperature). A
request with a grammar then has the ids it forbids masked (``mask_batch``; ``ppsplit.serve.structured``).

Randomness is counter-based: the uniform a request draws with is a hash of its seed, the output index of the token
being drawn and what it is drawn for (``SALT_*``), computed with tensor ops on the device for every request of a step
at once. So the same seed gives the same tokens whatever the batch companions are, and no draw reads the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.serve.structured import Grammar

GREEDY_BELOW = 1e-5  # as vLLM: a smaller temperature decodes greedily (dividing by it would overflow to inf)
SALT_TARGET, SALT_ACCEPT, SALT_DRAFT = 0, 1, 2  # a target draw, a draft's acceptance test, a drafter's draw
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. ``max_tokens``: new tokens at most; ``stop_token_ids``: end the output (the token is
    kept, as an end-of-sequence token is); ``ignore_eos``: keep going past the model's end-of-sequence ids;
    ``min_tokens``: no stop id is drawn before that many tokens; ``presence_penalty`` / ``frequency_penalty`` (-2 to
    2), ``repetition_penalty`` (> 0, 1: none), ``logit_bias`` (``{token id: bias}``, -100 to 100): see the module
    docstring; ``logprobs``: return each new token's log-probability and the ``logprobs`` most likely alternatives
    (0 to ``MAX_LOGPROBS``), ``None``: none; ``prompt_logprobs``: the same for each prompt token after the first;
    ``logprobs_adjusted``: the output's logprobs are those of the adjusted logits (bias, ``min_tokens``, penalties;
    before temperature), vLLM's processed logprobs, which ``best_of`` ranks by; else the model's.
    ``grammar``: a ``ppsplit.serve.structured.Grammar`` the output follows (its token mask applied after the
    adjustments, before temperature), ending the request where the grammar ends.

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
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    logprobs_adjusted: bool = False

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
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), but got "
                              f"{self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ConfigError(f"{name} must be a number from -2 to 2 (0: none), but got {value!r}")
            object.__setattr__(self, name, float(value))
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise ConfigError(f"repetition_penalty must be a number in (0, 100] (1: none), but got "
                              f"{self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t) if isinstance(t, str) and t.strip().isdigit() else t, b) for t, b in bias))
        except (TypeError, ValueError):
            bias = None
        if bias is None or len(bias) > MAX_LOGIT_BIAS or not all(
                _is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in bias):
            raise ConfigError(f"logit_bias must map up to {MAX_LOGIT_BIAS} token ids to biases from -100 to 100, but "
                              f"got {str(self.logit_bias)[:80]}")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (the alternatives returned per "
                                  f"token) or None, but got {value!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ConfigError(f"grammar must be a ppsplit.serve.structured.Grammar (Grammars.compile), but got "
                              f"{type(self.grammar).__name__}")
        if not isinstance(self.logprobs_adjusted, bool):
            raise ConfigError(f"logprobs_adjusted must be true or false, but got {self.logprobs_adjusted!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusted(self) -> bool:
        """Whether the logits are changed before sampling (a bias, ``min_tokens`` or a penalty)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, prompt, output, stops=()) -> torch.Tensor:
    """One request's logits ``[V]`` for its next token after ``prompt`` and ``output`` (token ids), adjusted as the
    module docstring says (``stops``: its end-of-sequence ids, unless it ignores them); float32. The per-request
    reference of ``Sampler``'s batched adjustment."""
    logits = logits.float().clone()
    for token, bias in params.logit_bias:
        if token < logits.shape[-1]:
            logits[token] += bias
    if len(output) < params.min_tokens:
        for token in set(stops) | set(params.stop_token_ids):
            if token < logits.shape[-1]:
                logits[token] = float("-inf")
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=logits.shape[-1]).float()
    seen = counts > 0
    seen[torch.tensor(list(prompt), dtype=torch.long)] = True
    penalty = torch.where(seen, torch.tensor(params.repetition_penalty), torch.tensor(1.0))
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


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


def mask_batch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [R, J, V]`` with the ids a grammar forbids at ``-inf``: ``bitmask`` int32 ``[R, J, ceil(V / 32)]``,
    bit ``v % 32`` of word ``v // 32`` set where id ``v`` is allowed (xgrammar's layout)."""
    v = torch.arange(logits.shape[-1], device=logits.device)
    allowed = (bitmask[..., v >> 5] >> (v & 31).int()) & 1
    return logits.masked_fill(allowed == 0, float("-inf"))


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

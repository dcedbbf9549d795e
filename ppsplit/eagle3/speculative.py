"""Speculative decoding with an EAGLE-3 drafter on the last stage: the acceptance rules and the loop.

Per step: the drafter proposes ``K`` tokens (a chain) from the target's taps; all stages verify the last
committed token plus the ``K`` drafts in one ``K + 1``-token pass; the longest accepted prefix plus one token from
the target are committed. Greedy (``temperature == 0``): a draft is accepted while it equals the target's argmax.
Sampling: the rejection rule of Leviathan et al. / Chen et al. (accept ``d`` with probability
``min(1, p(d) / q(d))``; at the first rejection sample from ``norm(max(0, p - q))``; after ``K`` acceptances
sample the bonus token from ``p``), so every committed token is distributed as the target's softmax.

Batches: the stage contract has one ``positions [T]`` for the whole batch, so every sequence of a batch must sit
at the same cache position. Each sequence's acceptance is computed on its own; the batch then commits
``n = min`` over its unfinished sequences of the accepted counts, plus each sequence's token at index ``n``
(the target's own token where that sequence stopped accepting, else its accepted draft ``n``). This is exact for
greedy decoding and lossless for sampling: whether index ``i`` is emitted is decided from the acceptances of
indices ``< i`` (of this and of the other, independent, sequences), never from the token at ``i`` itself.
Rejected and uncommitted positions are left in the caches and overwritten by the next pass (no rollback).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.generation import EndOfSequence


@dataclass
class SpeculativeStats:
    """What a speculative ``generate`` did. ``draft_tokens[s]``: the ``K`` target-vocab ids the drafter proposed
    at verify step ``s`` (first sequence); ``accepted[s]``: how many of them the first sequence's acceptance rule
    took; ``committed[s]``: drafts committed for the whole batch (the minimum over unfinished sequences; equals
    ``accepted`` at batch 1); ``verify_passes``: ``K + 1``-token passes through the stages."""

    num_draft_tokens: int
    draft_tokens: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    committed: list = field(default_factory=list)
    verify_passes: int = 0

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verify pass by the first sequence: ``1 + mean(accepted)``."""
        return 1.0 + sum(self.accepted) / max(1, len(self.accepted))


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One id per row of ``probs [..., V]`` (unnormalised is fine), by the exponential race
    ``argmax(p / E)``, ``E ~ Exp(1)``: exact, and without a host synchronisation (unlike ``multinomial``)."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / race).argmax(-1)


def accept(draft: torch.Tensor, target_logits: torch.Tensor, temperature: float = 0.0,
           draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None):
    """Acceptance of one verify pass, per sequence. ``draft [B, K]`` target-vocab ids; ``target_logits
    [B, K + 1, V]`` the target's logits at the last committed token and the ``K`` drafts; for ``temperature > 0``
    also ``draft_probs [B, K, V]``, the distributions the drafts were sampled from. Returns ``(n [B], token [B])``:
    drafts accepted, and the token at index ``n`` (the correction after a rejection, or the bonus token).

    Example::

        n, token = accept(drafts, logits)              # greedy: longest prefix equal to the argmax
        n, token = accept(drafts, logits, 0.8, q, g)   # rejection sampling; lossless
    """
    batch, k = draft.shape
    if temperature <= 0:
        best = target_logits.argmax(-1)
        n = torch.cumprod((best[:, :k] == draft).long(), dim=1).sum(1)
        return n, best.gather(1, n[:, None])[:, 0]
    if draft_probs is None:
        raise ConfigError("sampling (temperature > 0) needs the drafts' probabilities draft_probs [B, K, V]")
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = draft_probs.float()
    p_d = p[:, :k].gather(2, draft[..., None])[..., 0]
    q_d = q.gather(2, draft[..., None])[..., 0]
    u = torch.rand(batch, k, device=p.device, generator=generator)
    ok = u * q_d < p_d  # u < p/q without dividing (q_d > 0 for a sampled draft)
    n = torch.cumprod(ok.long(), dim=1).sum(1)
    # Row n of [max(0, p - q) for each draft position ..., p after the last one]: the distribution of the token at n.
    residual = torch.cat([(p[:, :k] - q).clamp_min(0), p[:, k:]], dim=1)
    row = residual.gather(1, n[:, None, None].expand(batch, 1, residual.shape[-1]))[:, 0]
    return n, sample(row, generator)


@torch.no_grad()
def generate(split, input_ids: torch.Tensor, max_new_tokens: int, drafter, num_draft_tokens: int = 4,
             temperature: float = 0.0, generator: torch.Generator | None = None):
    """Speculative decoding through ``split`` with ``drafter`` (see the module docstring). Returns
    ``(ids [B, prompt + new], SpeculativeStats)``. Greedy output equals ``split.generate`` (and Hugging Face's
    ``generate(do_sample=False)``) token for token, end-of-sequence handling included.

    Example::

        out, stats = speculative.generate(split, ids, 64, drafter, num_draft_tokens=4)
        print(stats.mean_acceptance_length)
    """
    k = num_draft_tokens
    check_speculation(split.plan, k, drafter)
    batch, prompt = input_ids.shape
    split.check_fits(batch, prompt + max_new_tokens + k)  # a verify pass writes K positions past the last token
    if drafter.cache_keys is None or drafter.cache_keys.shape[0] < batch \
            or drafter.cache_keys.shape[2] < prompt + max_new_tokens + k:
        drafter.allocate_cache(split.plan.max_batch, split.plan.max_len)
    split.check_inputs(input_ids, torch.arange(prompt, device=input_ids.device))

    def forward(ids, positions):  # in range by the checks above: skip the per-call check (a host read)
        return split(ids, positions, check=False)

    return decode(forward, input_ids, max_new_tokens, drafter, k, temperature, generator,
                  eos_token_id=split.eos_token_id, pad_token_id=split.pad_token_id)


def check_num_draft_tokens(k) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"num_draft_tokens must be an integer >= 1, but got {k!r}")


def check_speculation(plan, k, drafter=None) -> None:
    """What speculative decoding needs, checked in one place: ``k >= 1`` drafts, a drafter that reads taps the split
    carries, and a verify pass of ``k + 1`` tokens that fits the recurrent layers' ring of states (or rejected
    drafts could not be taken back)."""
    check_num_draft_tokens(k)
    if drafter is not None and (not drafter.taps or any(t not in plan.taps for t in drafter.taps)):
        raise ConfigError(f"the drafter reads taps {list(drafter.taps)} but the split carries {list(plan.taps)}; "
                          "compile or split the target with the drafter's taps (ppsplit compile MODEL --drafter "
                          "DRAFTER, or load_drafter(path, split=split))")
    if plan.state_slots and k + 1 > plan.state_slots:
        raise ConfigError(f"num_draft_tokens={k} needs {k + 1} states per recurrent layer, but its cache keeps "
                          f"{plan.state_slots}; use num_draft_tokens <= {plan.state_slots - 1}")


@torch.no_grad()
def decode(forward, input_ids: torch.Tensor, max_new_tokens: int, drafter, k: int, temperature: float = 0.0,
           generator: torch.Generator | None = None, *, eos_token_id=(), pad_token_id: int | None = None):
    """The speculative loop over any target ``forward(ids [B, T], positions [T]) -> (logits, aux)`` that runs all
    stages (in process: the ``SplitModel``). Checks are ``generate``'s job."""
    device = input_ids.device
    loop = steps(input_ids, max_new_tokens, drafter, k, temperature, generator, eos_token_id=eos_token_id,
                 pad_token_id=pad_token_id)
    ids, start = next(loop)
    while True:
        try:
            ids, start = loop.send(forward(ids, torch.arange(start, start + ids.shape[1], device=device)))
        except StopIteration as done:
            return done.value


def steps(input_ids: torch.Tensor, max_new_tokens: int, drafter, k: int, temperature: float = 0.0,
          generator: torch.Generator | None = None, *, eos_token_id=(), pad_token_id: int | None = None):
    """``decode`` as a generator, for a runtime that runs the target passes itself (the multi-process pipeline
    keeps one per group in flight): yields ``(ids [B, T], start)``, the target pass to run at positions
    ``start .. start + T - 1`` (the prefill first, then one ``K + 1``-token verify pass per step), and takes back
    its ``(logits, aux)``; returns ``(ids [B, prompt + new], SpeculativeStats)``. Every yield after the first comes
    after the draft that read the previous pass's ``aux``, so the runtime may reuse that buffer."""
    batch, prompt = input_ids.shape
    device = input_ids.device
    last = drafter.fc.weight.device
    eos = EndOfSequence(eos_token_id, pad_token_id, device)
    stats = SpeculativeStats(num_draft_tokens=k)

    def pick(logits):
        if temperature <= 0:
            return logits.argmax(-1)
        return sample(torch.softmax(logits.float() / temperature, dim=-1), generator)

    logits, aux = yield input_ids, 0
    token = pick(logits[:, -1]).to(last)
    # The drafter pairs the taps of position i with the token at i + 1.
    window = (aux.to(last), torch.cat([input_ids[:, 1:].to(last), token[:, None]], 1), torch.arange(prompt, device=last))
    index = prompt - 1
    out, done = [], eos.new_done(batch)
    pos = prompt  # cache position of ``token``, the last committed token (not yet through the target)

    def commit(t) -> bool:  # one token per sequence; True when the output is complete
        out.append(eos.apply(t.to(device), done)[:, None])
        return len(out) >= max_new_tokens or eos.all_done(done)

    finished = commit(token)
    while not finished:
        drafts, q = drafter.draft(*window, index, k, temperature, generator)
        verify = torch.cat([token[:, None], drafts], 1)
        logits, aux = yield verify.to(device), pos
        stats.verify_passes += 1
        n_seq, nxt = accept(drafts, logits.to(last), temperature, q, generator)
        active = ~done.to(last)
        n = int(n_seq[active].min()) if bool(active.any()) else 0
        stats.draft_tokens.append(drafts[0].tolist())
        stats.accepted.append(int(n_seq[0]))
        stats.committed.append(n)
        # Each sequence's token at index n: its accepted draft n, or its own correction / bonus token.
        chosen = torch.where(n_seq > n, torch.cat([drafts, drafts[:, :1]], 1)[:, n], nxt)
        tokens = torch.cat([drafts[:, :n], chosen[:, None]], 1)
        for i in range(n + 1):
            finished = commit(tokens[:, i])
            if finished:
                break
        token = tokens[:, n]
        window = (aux.to(last), torch.cat([tokens, drafts[:, n:]], 1), torch.arange(pos, pos + k + 1, device=last))
        index = n
        pos += n + 1
    return torch.cat([input_ids, torch.cat(out, 1)], 1), stats


@torch.no_grad()
def draft_agreement(split, drafter, ids: torch.Tensor, start: int = 1) -> tuple[int, int]:
    """Teacher-forced first-draft agreement on ``ids [B, T]``: how often the drafter, fed the target's taps of
    position ``i`` and token ``i + 1``, predicts the target's own greedy token at ``i + 2`` (for ``i + 1 >= start``).
    Returns ``(agreeing, total)``. A drafter read under the wrong tap numbering scores near zero.

    Example::

        agree, total = draft_agreement(split, drafter, sequences, start=4)
    """
    batch, tokens = ids.shape
    device, last = ids.device, drafter.fc.weight.device
    logits, aux = split(ids, torch.arange(tokens, device=device))
    target_next = logits.argmax(-1).to(last)  # [B, T]: the target's token for position i + 1
    ids = ids.to(last)
    draft_logits, _ = drafter(aux.to(last), torch.cat([ids[:, 1:], target_next[:, -1:]], 1),
                              torch.arange(tokens, device=last))
    drafts = drafter.target_ids[draft_logits.argmax(-1)]  # [B, T]: the drafter's token for position i + 2
    lo = max(start - 1, 0)
    hits = drafts[:, lo:tokens - 1] == target_next[:, lo + 1:]
    return int(hits.sum()), hits.numel()

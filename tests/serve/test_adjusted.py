"""Logits adjusted in the engine's batched sampler (logit_bias, min_tokens, presence / frequency / repetition
penalties) and logprobs, against a per-request reference (``sampling.adjusted_logits``, written from vLLM's and
OpenAI's definitions) over Hugging Face's logits, one request at a time (fp32, CPU)."""
from dataclasses import replace

import pytest
import torch

import ppsplit
from ppsplit import CacheConfig, ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams, adjusted_logits
from tests.serve.test_engine import HostReads
from tests.support import drafter_config, random_drafter_tensors, tiny_model, write_drafter

EOS = 2
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    return model, ppsplit.trace_model(model, cache=CacheConfig(batch_size=6, max_len=64, num_blocks=14))


def reference(model, prompt, params: SamplingParams):
    """Greedy decoding of one request: argmax of ``adjusted_logits`` of HF's logits; ``(ids, logprobs)`` where
    logprobs are ``log_softmax`` of HF's logits at each chosen id (of the adjusted ones with ``logprobs_adjusted``)."""
    out, logprobs = [], []
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            adjusted = adjusted_logits(logits, params, prompt, out, () if params.ignore_eos else (EOS,))
            token = int(adjusted.argmax())
            out.append(token)
            logprobs.append(torch.log_softmax((adjusted if params.logprobs_adjusted else logits).float(), -1))
            if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
                break
    return out, logprobs


def cases():
    prompts = [[5, 9, 3, 9, 9, 40], [7, 7, 7, 7], [11, 60, 12, 90, 4, 4, 31, 8, 8, 8, 100], [3, 4], [50, 51, 52]]
    params = [SamplingParams(max_tokens=14, repetition_penalty=1.8, ignore_eos=True),
              SamplingParams(max_tokens=12, frequency_penalty=1.5, presence_penalty=0.7),
              SamplingParams(max_tokens=10, repetition_penalty=0.6, frequency_penalty=-0.5, logprobs=3,
                             prompt_logprobs=2),
              SamplingParams(max_tokens=9, min_tokens=6, logit_bias={EOS: 100.0, 77: 4.0}, stop_token_ids=(77,)),
              SamplingParams(max_tokens=11, logit_bias={13: -100, 14: 2.5}, logprobs=0)]
    return prompts, params


@pytest.mark.parametrize("pp, lag, k", [(1, False, 0), (2, True, 0), (2, False, 3)])
def test_adjusted_greedy_requests_each_equal_the_reference(tmp_path, llama, pp, lag, k):
    """Five requests, each with its own adjustment, batched with two plain ones (which stay equal to plain greedy);
    with a drafter (K = 3) the verify window adjusts each row for the drafts before it."""
    model, traced = llama
    split = ppsplit.split_model(traced, pp, aux=[1, 2, 4] if k else None)
    drafter = None
    if k:
        cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
        drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)),
                                       split=split)
    prompts, params = cases()
    prompts += [[8, 9, 10], [20, 21]]
    prompts += [list(range(30, 60))]  # a prompt read in two chunks, its logprobs kept from both
    params += [SamplingParams(max_tokens=8, logprobs=2), SamplingParams(max_tokens=8, ignore_eos=True),
               SamplingParams(max_tokens=3, prompt_logprobs=0)]
    # vLLM's processed logprobs (what best_of ranks by): penalties, and a bias with min_tokens
    prompts += [prompts[2], prompts[3]]
    params += [replace(params[2], prompt_logprobs=None, logprobs_adjusted=True),
               replace(params[3], logprobs=2, logprobs_adjusted=True)]
    engine = Engine(split, drafter=drafter, num_draft_tokens=k, async_scheduling=lag, max_num_batched_tokens=24)
    outs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        ids, logprobs = reference(model, prompt, p)
        assert out.token_ids == ids, (prompt, p)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs == []
        else:
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            for i, (lp, top) in enumerate(out.prompt_logprobs[1:]):
                torch.testing.assert_close(lp, ref[i, prompt[i + 1]].item(), atol=1e-4, rtol=0)
                assert [t for t, _ in top] == torch.topk(ref[i], p.prompt_logprobs).indices.tolist()
        if p.logprobs is None:
            assert out.logprobs == []
            continue
        assert len(out.logprobs) == len(ids)
        for token, (lp, top), ref in zip(ids, out.logprobs, logprobs):
            torch.testing.assert_close(lp, ref[token].item(), atol=1e-4, rtol=0)
            want = torch.topk(ref, p.logprobs)
            assert [t for t, _ in top] == want.indices.tolist()
            torch.testing.assert_close([v for _, v in top], want.values.tolist(), atol=1e-4, rtol=0)
    assert engine.blocks_in_use == 0


def test_the_adjustments_change_the_output(llama):
    """The cases are not vacuous: each adjusted request decodes differently from plain greedy, and min_tokens held
    back a stop id that greedy takes first."""
    model, _ = llama
    prompts, params = cases()
    changed = 0
    for prompt, p in zip(prompts, params):
        plain = SamplingParams(max_tokens=p.max_tokens, ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids)
        changed += reference(model, prompt, p)[0] != reference(model, prompt, plain)[0]
    assert changed == len(prompts)
    ids, _ = reference(model, prompts[3], params[3])
    assert ids[:6].count(EOS) == 0 and ids[6] == EOS


def test_sampled_adjusted_requests_repeat_with_their_seed_and_respect_min_tokens(llama):
    model, traced = llama
    split = ppsplit.split_model(traced, 1)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, min_tokens=10, logit_bias={EOS: 8.0},
                             presence_penalty=1.0) for s in range(4)]
    first = [o.token_ids for o in Engine(split).generate([[4, 5, 6]] * 4, params)]
    again = [o.token_ids for o in Engine(split).generate([[4, 5, 6]] * 4, params)]
    assert first == again and len({tuple(t) for t in first}) == 4
    assert all(len(t) == 10 and EOS not in t for t in first)


def test_bad_fields_are_refused_in_one_line(llama):
    _, traced = llama
    engine = Engine(ppsplit.split_model(traced, 1))
    for kwargs, says in [(dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition"),
                         (dict(min_tokens=20), "min_tokens"), (dict(logit_bias={5: 101}), "logit_bias"),
                         (dict(logprobs=21), "logprobs"), (dict(logit_bias={"x": 1}), "logit_bias")]:
        with pytest.raises(ConfigError, match=says):
            SamplingParams(max_tokens=16, **kwargs)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(logit_bias={500: 1.0}))


@pytest.mark.parametrize("lag", [False, True])
def test_adjusted_and_logprob_steps_still_read_the_device_once(llama, lag):
    model, _ = llama
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(16, 64)), 2)
    counts = {}
    for n in (1, 16):
        engine = Engine(split, async_scheduling=lag)
        for i in range(n):
            engine.add_request([5 + i, 6, 7], SamplingParams(
                max_tokens=20, ignore_eos=True, seed=i, temperature=0.7 * (i % 2), repetition_penalty=1.2,
                frequency_penalty=0.5, min_tokens=3, logit_bias={9: 1.0}, logprobs=i % 3))
        engine.step()
        reads = HostReads()
        with reads:
            engine.step()
        counts[n] = reads.count
    assert counts[16] == counts[1] <= 1, counts


def test_speculative_sampling_with_adjustments_follows_the_adjusted_distribution(tmp_path):
    """1200 sampled pairs of tokens with a bias, a repetition and a presence penalty, through a drafter (K = 2) that
    knows nothing of them: the pair follows the target's adjusted, filtered joint distribution (chi-square
    p > 0.001), so the rejection rule verified against the adjusted distribution."""
    from tests.serve.test_engine import chi_square_p, small_target
    from ppsplit.serve.sampling import filtered_probs

    model, split = small_target()
    cfg = drafter_config(model.config, aux_ids=[0, 1, 3], draft_vocab=24)
    drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)), split=split)
    prompt = [5, 9, 3]
    base = dict(max_tokens=2, temperature=0.8, top_p=0.95, logit_bias={7: 1.5, 9: 2.0}, repetition_penalty=1.5,
                presence_penalty=1.0)
    params = [SamplingParams(seed=s, **base) for s in range(1200)]
    pairs = []
    for i in range(0, 1200, 200):
        engine = Engine(split, drafter=drafter, num_draft_tokens=2)
        pairs += [tuple(o.token_ids) for o in engine.generate([prompt] * 200, params[i:i + 200])]
    p = params[0]
    with torch.no_grad():
        first = filtered_probs(adjusted_logits(model(torch.tensor([prompt])).logits[0, -1], p, prompt, []), p)
        joint = torch.zeros(32, 32, dtype=torch.float64)
        for a in range(32):
            if first[a] > 0:
                logits = model(torch.tensor([prompt + [a]])).logits[0, -1]
                joint[a] = first[a].double() * filtered_probs(adjusted_logits(logits, p, prompt, [a]), p).double()
    counts = torch.zeros(32, 32)
    for a, b in pairs:
        counts[a, b] += 1
    assert counts[joint == 0].sum() == 0
    live = joint.flatten() > 0
    assert chi_square_p(counts.flatten()[live].tolist(), (joint.flatten()[live] / joint.sum()).tolist()) > 1e-3
    plain = SamplingParams(max_tokens=2, temperature=0.8, top_p=0.95)
    with torch.no_grad():
        unadjusted = filtered_probs(model(torch.tensor([prompt])).logits[0, -1], plain)
    assert (unadjusted - first).abs().sum() > 0.2  # the adjustment moves the distribution


def test_the_compact_slot_state_equals_the_reference_at_its_limits():
    """The state is bool masks, int16 counts (a sequence of 512 positions) and a sparse bias: three requests admitted
    in one step (300 biased ids, prompts repeating ids, an output after a preemption, stop ids given twice), then one
    slot admitted again (its old state cleared): the batched adjustment equals ``adjusted_logits`` per request."""
    from ppsplit.serve.sampler import Sampler
    from ppsplit.serve.scheduler import Admission

    vocab, g = 1000, torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    sampler = Sampler(4, "cpu", max_len=512)

    def check(requests):
        sampler.admit([Admission(slot, p, 0, len(out), tuple(prompt), tuple(out), (EOS, EOS) + p.stop_token_ids)
                       for slot, p, prompt, out in requests])
        slot = torch.tensor([r[0] for r in requests])
        logits = torch.randn(len(requests), 1, vocab, generator=g) * 3
        got = sampler.adjust(logits, slot, torch.zeros(len(requests), 0, dtype=torch.long),
                             torch.zeros(len(requests), dtype=torch.long), sampler.index[slot])
        for i, (_, p, prompt, out) in enumerate(requests):
            want = adjusted_logits(logits[i, 0], p, prompt, out, (EOS,))
            torch.testing.assert_close(got[i, 0], want, rtol=1e-6, atol=1e-5)

    biased = dict(zip(ids(300), torch.linspace(-100, 100, 300).tolist()))
    check([(0, SamplingParams(max_tokens=60, logit_bias=biased, repetition_penalty=1.3), ids(40), []),
           (1, SamplingParams(max_tokens=60, frequency_penalty=0.8, presence_penalty=-0.4, min_tokens=30,
                              stop_token_ids=(5, 5, 9)), [7] * 12 + ids(5), [3, 3, 3] + ids(20)),
           (3, SamplingParams(max_tokens=9, logit_bias={4: 2.0, 999: -3.5}, min_tokens=2), [4, 4], [])])
    check([(0, SamplingParams(max_tokens=8, logit_bias={17: 1.5}, presence_penalty=1.0), [17, 18], [18])])
    assert (sampler.counts.dtype, sampler.seen.dtype, sampler.stops.dtype) == (torch.int16, torch.bool, torch.bool)
    assert Sampler(4, "cpu", max_len=1 << 15).count_dtype == torch.int32

"""The engine loop: continuous batching of requests of any length, per-request sampling and per-request EAGLE-3
acceptance, against Hugging Face run one request at a time (fp32, CPU)."""
import math
import random

import pytest
import torch

import ppsplit
from ppsplit import CacheConfig, ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams, filtered_probs
from tests.support import drafter_config, random_drafter_tensors, tiny_model, write_drafter

V = 128


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    return model, ppsplit.trace_model(model, cache=CacheConfig(batch_size=4, max_len=80, num_blocks=14))


def hf(model, prompt, params: SamplingParams):
    eos = [2] + list(params.stop_token_ids)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False,
                             eos_token_id=None if params.ignore_eos else eos)
    return out[0, len(prompt):].tolist()


def requests(n=12, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, V) for _ in range(rng.randrange(2, 49))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(4, 20), stop_token_ids=(rng.randrange(3, V),),
                             ignore_eos=rng.random() < 0.5) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("pp, lag", [(1, False), (2, False), (2, True)])
def test_requests_arriving_at_different_steps_each_equal_hf_alone(llama, pp, lag):
    """``lag``: async scheduling (two steps in flight, windows filled in from the device), as on one GPU."""
    model, traced = llama
    engine = Engine(ppsplit.split_model(traced, pp), max_num_batched_tokens=32,  # 14 blocks: preemption happens
                    async_scheduling=lag)
    prompts, params = requests()
    arrivals = {i: i // 2 for i in range(len(prompts))}  # two new requests every step
    outputs, step, ids = {}, 0, {}
    while len(outputs) < len(prompts):
        for i, at in arrivals.items():
            if at == step:
                ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
        step += 1
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert outputs[i].token_ids == hf(model, prompt, p), i
        assert outputs[i].finish_reason == ("length" if len(outputs[i].token_ids) == p.max_tokens
                                            and outputs[i].token_ids[-1] not in (2, *p.stop_token_ids) else "stop")
    assert engine.blocks_in_use == 0 and not engine.has_unfinished()


def test_streaming_gives_every_token_once(llama):
    model, traced = llama
    engine = Engine(ppsplit.split_model(traced, 1))
    prompts, params = requests(4, seed=1)
    seen = {}
    for out in engine.stream(prompts, params):
        seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert seen[out.request_id] == out.token_ids
    assert [seen[str(i)] for i in range(4)] == [hf(model, p, sp) for p, sp in zip(prompts, params)]


def test_abort_frees_the_blocks_and_the_others_finish(llama):
    model, traced = llama
    engine = Engine(ppsplit.split_model(traced, 2))
    prompts, params = requests(3, seed=2)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    engine.step()
    used = engine.blocks_in_use
    engine.abort(ids[1])
    assert engine.blocks_in_use < used
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out
    assert ids[1] not in final and engine.blocks_in_use == 0
    for i in (0, 2):
        assert final[ids[i]].token_ids == hf(model, prompts[i], params[i])


def test_requests_are_checked_at_add_request(llama):
    _, traced = llama
    engine = Engine(ppsplit.split_model(traced, 1))
    with pytest.raises(ConfigError, match="token id 99999 is outside the vocabulary of 128 ids"):
        engine.add_request([1, 99999])
    with pytest.raises(ConfigError, match="needs 91 positions, but a sequence of the cache holds 80"):
        engine.add_request(list(range(3, 78)), SamplingParams(max_tokens=16))
    with pytest.raises(ConfigError, match="at least one token"):
        engine.add_request([])
    for bad, message in ((dict(max_tokens=0), "max_tokens must be"), (dict(temperature=-1), "temperature must be"),
                         (dict(top_p=0), "top_p must be"), (dict(top_k=-2), "top_k must be")):
        with pytest.raises(ConfigError, match=message):
            SamplingParams(**bad)
    assert not engine.has_unfinished()


def test_a_seed_gives_the_same_tokens_whatever_the_batch(llama):
    _, traced = llama
    split = ppsplit.split_model(traced, 1)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    alone = Engine(split).generate([[5, 6, 7]], params)[0].token_ids
    others = [SamplingParams(max_tokens=9, temperature=1.0, seed=s, ignore_eos=True) for s in range(7)]
    for lag in (False, True):
        batch = Engine(split, async_scheduling=lag).generate([[9, 9, 9, 9]] * 3 + [[5, 6, 7]] + [[4, 4]] * 4,
                                                             others[:3] + [params] + others[3:])
        assert batch[3].token_ids == alone


def chi_square_p(counts, probs):
    """Pearson's chi-square p-value of ``counts`` against ``probs``; cells with small expectations are pooled, in
    order, into bins of at least 5 expected draws."""
    n = sum(counts)
    obs, exp, o_acc, e_acc = [], [], 0.0, 0.0
    for o, p in zip(counts, probs):
        o_acc, e_acc = o_acc + o, e_acc + p * n
        if e_acc >= 5:
            obs.append(o_acc)
            exp.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0:  # the remainder joins the last bin
        obs[-1] += o_acc
        exp[-1] += e_acc
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = torch.tensor((len(obs) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)).item()


def small_target():
    model = tiny_model("llama", vocab_size=32, eos_token_id=None)
    return model, ppsplit.split_model(model, 1, aux=[1, 2, 4], cache=CacheConfig(batch_size=200, max_len=16))


@pytest.mark.parametrize("with_drafter", [False, True])
def test_sampled_tokens_follow_the_filtered_softmax(tmp_path, with_drafter):
    """The first two tokens of 1200 sampled continuations of one prompt (200 at a time), at temperature 0.8 and
    top-p 0.9, against the target's own filtered distributions (the joint of the first token and the second given
    it): chi-square p > 0.001, and nothing outside top-p. With a drafter the second token comes through the
    rejection rule; the output must follow the same distribution."""
    model, split = small_target()
    drafter = None
    if with_drafter:
        cfg = drafter_config(model.config, aux_ids=[0, 1, 3], draft_vocab=24)
        drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)),
                                       split=split)
    params = [SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, seed=s) for s in range(1200)]
    prompt = [5, 9, 3]
    pairs = []
    for i in range(0, 1200, 200):
        engine = Engine(split, drafter=drafter, num_draft_tokens=2 if drafter else 0)
        pairs += [tuple(o.token_ids) for o in engine.generate([prompt] * 200, params[i:i + 200])]
    with torch.no_grad():
        first = filtered_probs(model(torch.tensor([prompt])).logits[0, -1], params[0])
        joint = torch.zeros(32, 32, dtype=torch.float64)
        for a in range(32):
            if first[a] > 0:
                second = filtered_probs(model(torch.tensor([prompt + [a]])).logits[0, -1], params[0])
                joint[a] = first[a].double() * second.double()
    counts = torch.zeros(32, 32)
    for a, b in pairs:
        counts[a, b] += 1
    assert counts[joint == 0].sum() == 0  # nothing outside top-p
    live = joint.flatten() > 0
    assert chi_square_p(counts.flatten()[live].tolist(), (joint.flatten()[live] / joint.sum()).tolist()) > 1e-3


def test_speculative_requests_accept_on_their_own(tmp_path, llama):
    """With a random drafter (K = 3): every request's output equals plain greedy, and its per-pass drafts and
    acceptances equal those of the same request run alone (its batch companions change nothing)."""
    model, traced = llama
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(8, 96)), 2, aux=[1, 2, 4])
    cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
    drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg, scale=2.0)),
                                   split=split)
    prompts, params = requests(6, seed=3)
    together = Engine(split, drafter=drafter, num_draft_tokens=3).generate(prompts, params)
    lagged = Engine(split, drafter=drafter, num_draft_tokens=3, async_scheduling=True).generate(prompts, params)
    for prompt, p, out, other in zip(prompts, params, together, lagged):
        alone = Engine(split, drafter=drafter, num_draft_tokens=3).generate([prompt], p)[0]
        assert out.token_ids == hf(model, prompt, p)
        assert out.drafts == alone.drafts and out.accepted == alone.accepted
        assert (other.token_ids, other.drafts, other.accepted) == (out.token_ids, out.drafts, out.accepted)


def test_a_hybrid_speculates_per_request_like_alone(tmp_path):
    """Qwen3-Next (Gated DeltaNet rings per sequence slot) with a random drafter, K = 3: every request's output equals
    Hugging Face's greedy output, and its drafts and acceptances are those it gets alone (rejected drafts leave the
    ring states of the accepted prefix for the next step)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "qwen3_next" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no qwen3_next")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_next", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
                               linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(4, 64)), 2, aux=[1, 2, 3])
    assert split.plan.paged, split.plan.lockstep_reason
    dcfg = drafter_config(model.config, aux_ids=[0, 1, 2])
    drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), dcfg, random_drafter_tensors(dcfg, scale=2.0)),
                                   split=split)
    prompts, params = requests(4, seed=5)
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    together = Engine(split, drafter=drafter, num_draft_tokens=3).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        alone = Engine(split, drafter=drafter, num_draft_tokens=3).generate([prompt], p)[0]
        assert out.token_ids == hf(model, prompt, p)
        assert out.drafts == alone.drafts and out.accepted == alone.accepted
    assert any(sum(o.accepted) < 3 * len(o.accepted) for o in together)  # some drafts were rejected
    # The rings keep a prompt's state per slot, outside the blocks: n choices fall back to prefilling on their own.
    engine, prompt = Engine(split), list(range(3, 24))
    final, fed, most = run_group(engine, prompt, [SamplingParams(max_tokens=5, ignore_eos=True)] * 2)
    assert not engine.scheduler.share_prompts and (fed, most) == (2 * len(prompt), 1)
    assert final[0].token_ids == final[1].token_ids == hf(model, prompt, SamplingParams(max_tokens=5, ignore_eos=True))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_mla_requests_each_equal_hf_alone(tmp_path, arch):
    """DeepSeek-V3 (MLA: latents and rotary keys in the paged pools) and V3.2 (sparse attention over the positions its
    indexer picks): requests of different lengths batched continuously, greedy and with an EAGLE-3 drafter (K = 3,
    verify windows over the latents), each give Hugging Face's greedy output."""
    from tests.serve.test_ragged import ARCHS, build

    if arch not in ARCHS:
        pytest.skip(f"this transformers has no {arch}")
    model, traced = build(arch)
    split = ppsplit.split_model(traced, 2, aux=[1, 2, 3])
    rng = random.Random(4)
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in (3, 17, 9, 30, 5)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 8, 15, 10, 6)]
    expected = [hf(model, prompt, p) for prompt, p in zip(prompts, params)]
    engine = Engine(split, max_num_batched_tokens=24)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.blocks_in_use == 0
    dcfg = drafter_config(model.config, aux_ids=[0, 1, 2])
    drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), dcfg, random_drafter_tensors(dcfg, scale=2.0)),
                                   split=split)
    speculative = Engine(split, drafter=drafter, num_draft_tokens=3).generate(prompts[:3], params[:3])
    assert [o.token_ids for o in speculative] == expected[:3]
    # Every step verified K + 1 tokens; rejected drafts' latents were overwritten by the next step's.
    assert all(o.accepted and sum(o.accepted) < 3 * len(o.accepted) for o in speculative)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of tensor values into Python (each one a device synchronisation on a GPU)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_drafter", [False, True])
@pytest.mark.parametrize("lag", [False, True])
def test_a_step_reads_the_device_once_whatever_the_batch(tmp_path, llama, with_drafter, lag):
    """During one ``Engine.step()`` (greedy and sampling requests mixed, drafts verified), the reads of tensor values
    into Python do not grow from 1 to 16 requests: one copy of the step's results."""
    model, _ = llama
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(16, 64)), 2, aux=[1, 2, 4])
    drafter = None
    if with_drafter:
        cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
        drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)),
                                       split=split)
    counts = {}
    for n in (1, 16):
        engine = Engine(split, drafter=drafter, num_draft_tokens=3 if drafter else 0, async_scheduling=lag)
        for i in range(n):
            engine.add_request([5 + i, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True, seed=i,
                                                             temperature=0.7 * (i % 2), top_p=0.9))
        engine.step()
        engine.step()
        reads = HostReads()
        with reads:
            engine.step()
        counts[n] = reads.count
    assert counts[16] == counts[1] <= 1, counts


# -- n choices of one prompt: its full blocks shared, copy-on-write ----------------------------------------------

def holders_match_refs(sched) -> None:
    """Every block's reference count is the number of requests holding it, and a free block has none."""
    held = {}
    for request in sched.requests.values():
        for b in request.blocks:
            held[b] = held.get(b, 0) + 1
    assert {b: int(r) for b, r in enumerate(sched.pool.refs) if r} == held
    assert sorted(sched.pool.free) == sorted(set(range(sched.pool.total)) - set(held))


def run_group(engine, prompt, params: list[SamplingParams], share=True, abort=None):
    """Add the choices (choice 0 the parent), run to the end checking the block counts after every step; the
    final outputs by choice, the prompt tokens scheduled and the most holders one block had."""
    sched, fed, most = engine.scheduler, [0], [0]
    schedule = sched.schedule

    def counted(*a, **kw):
        plan = schedule(*a, **kw)
        if plan is not None:
            fed[0] += sum(min(w.count, len(r.prompt) - w.position) for r, w in plan.entries
                          if not w.fed and w.position < len(r.prompt))
        return plan

    sched.schedule = counted
    ids = [engine.add_request(prompt, params[0])]
    ids += [engine.add_request(prompt, p, parent=ids[0] if share else None) for p in params[1:]]
    final, step = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[ids.index(out.request_id)] = out
        step += 1
        if abort is not None and step in abort:
            engine.abort(ids[abort[step]])
        holders_match_refs(sched)
        most[0] = max(most[0], int(sched.pool.refs.max()))
    assert engine.blocks_in_use == 0 and not sched.pool.refs.any()
    return final, fed[0], most[0]


@pytest.mark.parametrize("pp, lag", [(1, False), (2, False), (1, True)])
def test_n_choices_prefill_the_prompt_once_and_equal_independent_requests(llama, pp, lag):
    """A prompt of 2 blocks + 1 token: choice 0 prefills it, the other 3 share its 2 full blocks and compute only
    the last token (33 + 3 prompt tokens, not 4 x 33); each choice equals the same request made on its own."""
    _, traced = llama
    split = ppsplit.split_model(traced, pp)
    prompt = [random.Random(5).randrange(3, V) for _ in range(33)]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=40 + j, ignore_eos=True) for j in range(4)]
    shared, fed, most = run_group(Engine(split, async_scheduling=lag), prompt, params)
    alone, fed_alone, most_alone = run_group(Engine(split, async_scheduling=lag), prompt, params, share=False)
    assert (fed, most) == (33 + 3, 4) and (fed_alone, most_alone) == (4 * 33, 1)
    assert [shared[j].token_ids for j in range(4)] == [alone[j].token_ids for j in range(4)]
    assert len({tuple(shared[j].token_ids) for j in range(4)}) == 4


def test_greedy_choices_equal_hf_and_survive_preemption_and_aborts(llama):
    """Greedy choices equal each other and HF; 14 blocks for two groups of long outputs: choices are preempted
    (recomputed on their own) while others still read the shared blocks; an abort mid-way (of the parent, then of a
    choice) leaves the others' output alone; the counts return to zero."""
    model, traced = llama
    engine = Engine(ppsplit.split_model(traced, 2), max_num_batched_tokens=32)
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda r: (preempted.append(r.id), preempt(r))[1]
    prompt = list(range(3, 20))  # one full block shared; 4 x 77 positions need 17 blocks
    params = [SamplingParams(max_tokens=60, ignore_eos=True)] * 4
    expected = hf(model, prompt, params[0])
    final, _, most = run_group(engine, prompt, params)
    assert [final[j].token_ids for j in range(4)] == [expected] * 4 and preempted and most == 4
    final, _, _ = run_group(engine, prompt, params[:3], abort={4: 0, 9: 2})
    assert list(final) == [1] and final[1].token_ids == expected


def test_choices_held_for_a_parent_aborted_before_its_prefill_prefill_on_their_own(llama):
    model, traced = llama
    prompt = list(range(40, 80))
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * 3
    engine2 = Engine(ppsplit.split_model(traced, 1))
    parent = engine2.add_request(prompt, params[0])
    ids = [engine2.add_request(prompt, p, parent=parent) for p in params[1:]]
    engine2.abort(parent)
    outs = {}
    while engine2.has_unfinished():
        outs.update({o.request_id: o for o in engine2.step() if o.finished})
    assert [outs[i].token_ids for i in ids] == [hf(model, prompt, params[0])] * 2
    assert engine2.blocks_in_use == 0 and not engine2.scheduler.pool.refs.any()


def test_a_request_that_needs_the_whole_pool_takes_the_blocks_waiting_choices_share(llama):
    """A pool of 5 blocks, a request R that needs all 5, and 3 choices of a finished parent waiting (2 slots) with
    its first block: R takes that block back (the waiting choices then prefill on their own) instead of stalling."""
    model, _ = llama
    traced = ppsplit.trace_model(model, cache=CacheConfig(batch_size=4, max_len=80, num_blocks=5))
    engine = Engine(ppsplit.split_model(traced, 1), max_num_seqs=2)
    prompt, long = list(range(3, 20)), list(range(40, 80))
    params = [SamplingParams(max_tokens=1, ignore_eos=True)] + [SamplingParams(max_tokens=20, ignore_eos=True)] * 3
    parent = engine.add_request(prompt, params[0])
    ids = [parent] + [engine.add_request(prompt, p, parent=parent) for p in params[1:]]
    ids.append(engine.add_request(long, SamplingParams(max_tokens=36, ignore_eos=True)))
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        holders_match_refs(engine.scheduler)
    assert [final[i] for i in ids[1:4]] == [hf(model, prompt, params[1])] * 3
    assert final[ids[4]] == hf(model, long, SamplingParams(max_tokens=36, ignore_eos=True))
    assert engine.scheduler.shared_tokens >= 16 and engine.blocks_in_use == 0


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_choices_with_a_drafter_draft_as_independent_requests(tmp_path, family):
    """The drafter's cache rides the target's block tables, so the shared blocks hold its entries for the prompt too:
    each choice's drafts and acceptances are those of the same request made on its own, and its tokens HF greedy."""
    from tests.eagle3.test_dflash import BLOCK, TAPS, small, zlab_drafter

    model, traced = small()
    split = ppsplit.split_model(traced, 2, aux=TAPS)
    if family == "dflash":
        zlab_drafter(tmp_path / "z", 32, seed=1, scale=0.5)
        drafter, k = ppsplit.load_drafter(str(tmp_path / "z"), split=split), BLOCK - 1
    else:
        cfg = drafter_config(model.config, aux_ids=[t - 1 for t in TAPS])
        drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "e"), cfg, random_drafter_tensors(cfg, scale=2.0)),
                                       split=split)
        k = 3
    prompt = torch.randint(3, 32, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 3
    shared, fed, _ = run_group(Engine(split, drafter=drafter, num_draft_tokens=k), prompt, params)
    alone, _, _ = run_group(Engine(split, drafter=drafter, num_draft_tokens=k), prompt, params, share=False)
    assert fed == 21 + 2 * 5
    expected = hf(model, prompt, params[0])
    for j in range(3):
        assert shared[j].token_ids == alone[j].token_ids == expected
        assert (shared[j].drafts, shared[j].accepted) == (alone[j].drafts, alone[j].accepted)
    assert sum(sum(o.accepted) for o in shared.values()) > 0

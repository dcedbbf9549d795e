"""Structured output in the engine: a grammar's token mask applied in the batched sampler (``ppsplit.serve.structured``)
against a reference written here (Hugging Face's logits, masked by an xgrammar matcher stepped one token at a time),
with and without a drafter, async scheduling, and the masked distribution that sampling draws from (fp32, CPU)."""
import json
import re

import pytest
import torch

import ppsplit
from ppsplit import CacheConfig, ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams, filtered_probs
from tests.serve.test_engine import HostReads, chi_square_p
from tests.support import drafter_config, random_drafter_tensors, tiny_model, write_drafter

xgrammar = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2
# A character-level vocabulary of 32 tokens (the tiny models' size): the specials, JSON's punctuation, digits, letters.
CHARS = list('{}":,[] ') + list("0123456789") + list("abcdefxyz-.")
VOCAB = ["<unk>", "<s>", "</s>"] + CHARS
assert len(VOCAB) == 32


def char_tokenizer_json(vocab=VOCAB) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return tok.to_str()


def text(ids) -> str:
    return "".join(VOCAB[i] for i in ids if i > EOS)


@pytest.fixture(scope="module")
def grammars():
    from ppsplit.serve.structured import Grammars

    return Grammars(char_tokenizer_json(), 32, [EOS])


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama", vocab_size=32, eos_token_id=EOS)
    return model, ppsplit.trace_model(model, cache=CacheConfig(batch_size=8, max_len=64, num_blocks=40))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}
REGEX = r"[a-f]{2,5}-[0-9]{1,3}"
CHOICES = ["abc", "fed", "x.y"]


def requests(grammars):
    """Prompts and greedy params with a grammar each (and one without), ``max_tokens`` room to finish."""
    prompts = [[5, 9, 3, 9], [7, 7, 7], [11, 20, 12, 8, 4], [3, 4], [30, 31], [6, 6, 20]]
    kinds = [("json", json.dumps(SCHEMA)), ("regex", REGEX), ("choice", json.dumps(CHOICES)),
             ("json_object", ""), ("grammar", 'root ::= "[" [0-9] ("," [0-9])* "]"'), None]
    params = [SamplingParams(max_tokens=40, grammar=grammars.compile(*k) if k else None) for k in kinds]
    return prompts, kinds, params


def reference(model, prompt, params):
    """Greedy decoding of one request with HF's logits masked by a fresh matcher of its grammar."""
    matcher = xgrammar.GrammarMatcher(params.grammar.compiled) if params.grammar is not None else None
    bitmask = xgrammar.allocate_token_bitmask(1, 32)
    out = []
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask)
                allowed = torch.tensor([(int(bitmask[0, v // 32]) >> (v % 32)) & 1 for v in range(32)])
                logits[allowed == 0] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            if matcher is not None:
                assert matcher.accept_token(token)
                if matcher.is_terminated():
                    break
            if token == EOS:
                break
    return out


def check_valid(kind, ids):
    assert ids[-1] == EOS, ids
    s = text(ids)
    if kind[0] == "json":
        value = json.loads(s)
        assert set(value) == {"a", "b"} and isinstance(value["a"], int) and value["a"] <= 999 and value["b"] in ("x",
                                                                                                               "yz")
    elif kind[0] == "json_object":
        assert isinstance(json.loads(s), dict)
    elif kind[0] == "regex":
        assert re.fullmatch(REGEX, s)
    elif kind[0] == "choice":
        assert s in CHOICES
    else:
        assert re.fullmatch(r"\[[0-9](,[0-9])*\]", s)


@pytest.mark.parametrize("pp, lag, k", [(1, False, 0), (2, True, 0), (2, False, 3), (1, True, 2)])
def test_greedy_grammar_requests_equal_the_masked_reference(tmp_path, llama, grammars, pp, lag, k):
    """Five grammars and a plain request in one batch: each equals greedy decoding of HF's masked logits, ends with
    "stop" where its grammar ends, and its text is valid; with a drafter (K drafts each window) too, so drafts are
    checked against the grammar row by row."""
    model, traced = llama
    split = ppsplit.split_model(traced, pp, aux=[1, 2, 4] if k else None)
    drafter = None
    if k:
        cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
        drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)),
                                       split=split)
    prompts, kinds, params = requests(grammars)
    engine = Engine(split, drafter=drafter, num_draft_tokens=k, async_scheduling=lag, max_num_batched_tokens=24)
    outs = engine.generate(prompts, params)
    for prompt, kind, p, out in zip(prompts, kinds, params, outs):
        assert out.token_ids == reference(model, prompt, p), kind
        if kind is not None:
            assert out.finish_reason == "stop", (kind, text(out.token_ids))
            check_valid(kind, out.token_ids)
    assert engine.blocks_in_use == 0
    if k:
        assert sum(sum(o.accepted) for o in outs) > 0  # some drafts passed the grammar and were taken


def test_without_the_grammar_the_output_is_not_valid(llama, grammars):
    """The random model on its own writes none of these: the grammar is what makes the outputs above valid."""
    model, _ = llama
    prompts, kinds, params = requests(grammars)
    for prompt, kind in zip(prompts, kinds):
        if kind is None:
            continue
        ids = reference(model, prompt, SamplingParams(max_tokens=40))
        with pytest.raises((AssertionError, ValueError)):
            check_valid(kind, ids)


def test_sampling_draws_from_the_masked_distribution_through_the_rejection_rule(tmp_path, grammars):
    """1200 sampled pairs under the regex ``[a-f][0-9x]`` through a drafter (K = 2) that knows nothing of the
    grammar: the pair follows the target's masked, filtered joint distribution (chi-square p > 0.001), and nothing
    outside the grammar is ever drawn."""
    from tests.serve.test_engine import small_target

    model, split = small_target()
    cfg = drafter_config(model.config, aux_ids=[0, 1, 3], draft_vocab=24)
    drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)), split=split)
    grammar = grammars.compile("regex", "[a-f][0-9x]")
    prompt = [5, 9, 3]
    params = [SamplingParams(max_tokens=2, temperature=0.8, top_p=0.95, seed=s, grammar=grammar) for s in range(1200)]
    pairs = []
    for i in range(0, 1200, 200):
        engine = Engine(split, drafter=drafter, num_draft_tokens=2)
        pairs += [tuple(o.token_ids) for o in engine.generate([prompt] * 200, params[i:i + 200])]
    first_ok = torch.tensor([bool(re.fullmatch("[a-f]", v)) for v in VOCAB])
    second_ok = torch.tensor([bool(re.fullmatch("[0-9x]", v)) for v in VOCAB])
    p = params[0]
    with torch.no_grad():
        masked = lambda logits, ok: filtered_probs(logits.masked_fill(~ok, float("-inf")), p)  # noqa: E731
        first = masked(model(torch.tensor([prompt])).logits[0, -1], first_ok)
        joint = torch.zeros(32, 32, dtype=torch.float64)
        for a in range(32):
            if first[a] > 0:
                joint[a] = first[a].double() * masked(model(torch.tensor([prompt + [a]])).logits[0, -1],
                                                      second_ok).double()
    counts = torch.zeros(32, 32)
    for a, b in pairs:
        counts[a, b] += 1
    assert counts[joint == 0].sum() == 0
    live = joint.flatten() > 0
    assert chi_square_p(counts.flatten()[live].tolist(), (joint.flatten()[live] / joint.sum()).tolist()) > 1e-3
    with torch.no_grad():
        plain = filtered_probs(model(torch.tensor([prompt])).logits[0, -1], p)
    assert plain[~first_ok].sum() > 0.5  # unmasked, the model mostly writes something else


@pytest.mark.parametrize("lag", [False, True])
def test_grammar_steps_still_read_the_device_once(llama, grammars, lag):
    model, _ = llama
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(16, 64)), 2)
    grammar = grammars.compile("json_object", "")
    counts = {}
    for n in (1, 16):
        engine = Engine(split, async_scheduling=lag)
        for i in range(n):
            engine.add_request([5 + i, 6, 7], SamplingParams(max_tokens=30, seed=i, temperature=0.7 * (i % 2),
                                                             grammar=grammar if i % 4 != 3 else None))
        engine.step()
        reads = HostReads()
        with reads:
            engine.step()
        counts[n] = reads.count
    assert counts[16] == counts[1] <= 1, counts


def test_bad_grammars_are_refused_in_one_line(llama, grammars):
    from ppsplit.serve.structured import Grammars

    for kind, source, says in [("json", '{"type": "object", "properties":', "not valid"),
                               ("json", '{"type": "foo"}', "foo"), ("regex", "(abc", "not valid"),
                               ("grammar", "root ::= foo", "foo"), ("choice", "[]", "non-empty strings"),
                               ("regex", "a" * 70000, "more than"), ("lark", "x", "kind")]:
        with pytest.raises(ConfigError, match=says) as e:
            grammars.compile(kind, source)
        assert "\n" not in str(e.value)
    other = Grammars(char_tokenizer_json(VOCAB + ["q"]), 33, [EOS])
    engine = Engine(ppsplit.split_model(llama[1], 1))
    with pytest.raises(ConfigError, match="compiled for 33 token ids"):
        engine.add_request([1, 2], SamplingParams(grammar=other.compile("regex", "a+")))
    with pytest.raises(ConfigError, match="Grammar"):
        SamplingParams(grammar="a+")


def test_each_verify_row_is_masked_after_the_drafts_before_it(tmp_path, llama, grammars):
    """Drafts chosen here (K = 3): the next two tokens of the masked greedy reference, then a token the grammar
    forbids. The two are accepted only if rows 1 and 2 of the window are masked as the grammar stands after the
    drafts before them (unmasked, the model's own argmax differs), and the forbidden one is always rejected."""
    model, traced = llama
    split = ppsplit.split_model(traced, 1, aux=[1, 2, 4])
    cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
    drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)), split=split)
    for kind in [("regex", REGEX), ("json", json.dumps(SCHEMA))]:
        params = SamplingParams(max_tokens=40, grammar=grammars.compile(*kind))
        prompt = [5, 9, 3, 9]
        ref = reference(model, prompt, params)
        assert reference(model, prompt, SamplingParams(max_tokens=3))[:3] != ref[:3]  # unmasked, another path
        engine = Engine(split, drafter=drafter, num_draft_tokens=3)
        rid = engine.add_request(prompt, params)
        request, out = engine.scheduler.requests[rid], None
        while engine.has_unfinished():
            for out in engine.step():
                pass
            n = len(request.output)
            request.drafts = (ref[n:n + 2] + [0, 0])[:2] + [0]  # "<unk>": no grammar here allows it
        assert out.token_ids == ref and out.finish_reason == "stop"
        assert max(out.accepted) == 2 and 3 not in out.accepted, out.accepted
        assert sum(out.accepted) >= len(ref) // 2 - 2, (out.accepted, len(ref))


def test_a_compile_past_its_budget_is_refused_and_cached_grammars_are_shared():
    from ppsplit.serve.structured import Grammars

    slow = Grammars(char_tokenizer_json(), 32, [EOS], seconds=1e-4)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-f]{%d}" % (i % 9 + 1)}
                                               for i in range(600)}}
    with pytest.raises(ConfigError, match="took longer than"):
        slow.compile("json", json.dumps(schema))
    fast = Grammars(char_tokenizer_json(), 32, [EOS])
    assert fast.compile("regex", "[a-f]+") is fast.compile("regex", "[a-f]+")


def test_a_complete_grammar_ends_the_request_before_min_tokens(llama, grammars):
    """min_tokens holds the end-of-sequence back, but a complete grammar allows nothing else: the grammar wins."""
    _, traced = llama
    params = SamplingParams(max_tokens=30, min_tokens=20, grammar=grammars.compile("choice", json.dumps(CHOICES)))
    out = Engine(ppsplit.split_model(traced, 1)).generate([[5, 9, 3]], params)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS and text(out.token_ids) in CHOICES

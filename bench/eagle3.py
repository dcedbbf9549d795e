"""EAGLE-3 on the last stage, Llama-3.1-8B-shaped target (random bf16) and a random EAGLE-3 drafter (draft vocab
32000, the target's embedding shared), on one GPU.

    python bench/eagle3.py                  # on a CUDA GPU (H200: ~16 GB target + ~1 GB drafter)
    python bench/eagle3.py --tiny           # tiny shapes on the CPU: checks the script, times nothing real

Sections (each a table; every ratio is measured in this run, variants interleaved, CUDA graphs on the GPU):
  steps    one target decode step (T=1), one verify pass (T=K+1), one draft step (drafter on its own output), the
           drafter's window call (aux through the adapter, K+1 rows), the adapter alone; ratios to the decode step.
  adapter  fc over the slot-major aux [3, B, T, H] -> [B, T, H]: one addmm per tap (what the drafter does), one
           bmm then a sum, einsum, and concatenate-then-linear (materialises [B, T, 3H]), at T = 1, K+1, 2048.
  spec     tokens/s of speculative decoding from the step times, for the acceptance lengths given (--acceptance;
           default includes the mean acceptance length the trained drafter reached in tests/test_eagle3.py),
           against plain decoding; and the real generate loop (stages and the drafter's greedy draft captured; a
           random drafter accepts ~nothing, so this row measures the loop at acceptance length ~1).
"""
import argparse
import sys
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig
from ppsplit.eagle3.formats import build_drafter

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import graphed  # noqa: E402
from pipeline import interleaved as timed_interleaved, timer  # noqa: E402
from shapes import config  # noqa: E402

warnings.filterwarnings("ignore")
POSITION = 512  # decode position of the timed steps
TEST_ACCEPTANCE = 4.43  # tests/test_eagle3.py trained drafter, K=4 (CPU run, see bench/RESULTS.md section 6)


def interleaved(bench, fns: dict, rounds: int) -> dict:
    """Median time per variant over ``rounds`` interleaved measurements (pipeline.py's, without the spread)."""
    return {k: median for k, (median, _) in timed_interleaved(bench, fns, rounds).items()}


def random_drafter(split, target_cfg, embed, draft_vocab, device, intermediate):
    """A random EAGLE-3 drafter for the target (published Llama-3.1-8B EAGLE-3 shapes), built in place."""
    h = target_cfg.hidden_size
    heads, kv = target_cfg.num_attention_heads, target_cfg.num_key_value_heads
    hd = h // heads
    vocab = target_cfg.vocab_size
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "intermediate_size": intermediate,
           "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "vocab_size": vocab, "draft_vocab_size": draft_vocab, "max_position_embeddings": 131072,
           "rope_theta": getattr(target_cfg, "rope_theta", 500000.0),
           "rope_scaling": getattr(target_cfg, "rope_scaling", None),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in split.plan.taps]}}
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) / shape[-1] ** 0.5)

    t = {"fc.weight": w(h, 3 * h), "norm.weight": torch.ones(h, device=device), "lm_head.weight": w(draft_vocab, h),
         "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
         "midlayer.mlp.gate_proj.weight": w(intermediate, h), "midlayer.mlp.up_proj.weight": w(intermediate, h),
         "midlayer.mlp.down_proj.weight": w(h, intermediate)}
    for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        t[f"midlayer.{name}.weight"] = torch.ones(h, device=device)
    ids = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft_vocab]).values
    t["d2t"] = ids - torch.arange(draft_vocab)
    return build_drafter(cfg, t, split.plan, embed, "sglang", device)


def adapter_options(drafter):
    w = drafter.fc.weight
    n = len(drafter.slots)
    h, th = w.shape[0], w.shape[1] // n
    w_slots = w.view(h, n, th).permute(1, 2, 0)  # [n, Ht, H] view, no copy

    def addmm(aux):
        return drafter.adapt(aux)

    def bmm_sum(aux):
        _, b, t, _ = aux.shape
        return torch.bmm(aux.view(n, b * t, th), w_slots).sum(0).view(b, t, h)

    def einsum(aux):
        return torch.einsum("nbtk,hnk->bth", aux, w.view(h, n, th))

    def cat_linear(aux):
        return torch.nn.functional.linear(torch.cat(list(aux), -1), w)

    return {"addmm per tap": addmm, "bmm + sum": bmm_sum, "einsum": einsum, "cat + linear": cat_linear}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script only)")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--acceptance", default=f"1.0,2.0,3.0,{TEST_ACCEPTANCE}",
                    help="mean acceptance lengths (tokens per verify pass) to plug into the tokens/s estimate")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens of the real generate loop")
    ap.add_argument("--compile", action="store_true", help="also time the draft step compiled by Inductor")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    k = args.k
    batches = [int(b) for b in args.batches.split(",")]
    overrides = dict(num_hidden_layers=8, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=2048) if args.tiny else {}
    draft_vocab, intermediate = (1024, 512) if args.tiny else (32000, 14336)
    bench = timer(device)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, ppsplit {ppsplit.__version__}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config("llama-3.1-8b", **overrides), dtype=torch.bfloat16).eval()
    max_batch, max_len = max(batches), POSITION + args.new_tokens + 4 * k + 64
    traced = ppsplit.trace_model(model, cache=CacheConfig(max_batch, max_len))
    split = ppsplit.split_model(traced, 1, aux="eagle3")
    embed = model.get_input_embeddings().weight.detach()
    drafter = random_drafter(split, model.config, embed, draft_vocab, device, intermediate)
    print(f"target and drafter built in {time.perf_counter() - start:.0f}s; taps {split.plan.taps}; drafter "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.0f}M parameters, draft vocab {draft_vocab}")
    h = split.plan.hidden_size
    stage = split.stages[0]
    step_times = {}

    print(f"\n== steps: captured, position {POSITION}; ratios to one target decode step ==")
    print(f"{'batch':>5} {'what':<34} {'us':>9} {'vs decode':>10}")
    drafter.graphs.clear()
    for b in batches:
        fns = {}
        for name, t in (("target decode step (T=1)", 1), (f"target verify pass (T=K+1={k + 1})", k + 1)):
            x = torch.randint(0, 1000, (b, t), device=device)
            pos = torch.arange(POSITION, POSITION + t, device=device)
            aux = split.new_aux(b, t, device)
            fns[name] = graphed(lambda x=x, pos=pos, aux=aux: stage(x, pos, aux), device)
        hid = torch.randn(b, 1, h, device=device, dtype=torch.bfloat16)
        tok = torch.randint(0, 1000, (b, 1), device=device)
        pos1 = torch.tensor([POSITION], device=device)
        fns["draft step (own output, T=1)"] = graphed(lambda: drafter.step(hid, tok, pos1), device)
        if args.compile:  # the same step with Inductor fusing its norms, rotary, cat and adds, captured the same way
            step = torch.compile(drafter.step, dynamic=False)
            fns["draft step, Inductor (T=1)"] = graphed(lambda: step(hid, tok, pos1), device)
        aux_w = torch.randn(split.plan.n_slots, b, k + 1, h, device=device, dtype=torch.bfloat16)
        tok_w = torch.randint(0, 1000, (b, k + 1), device=device)
        pos_w = torch.arange(POSITION, POSITION + k + 1, device=device)
        fns[f"drafter window call (aux, T={k + 1})"] = graphed(lambda: drafter(aux_w, tok_w, pos_w), device)
        fns[f"adapter alone (T={k + 1})"] = graphed(lambda: drafter.adapt(aux_w), device)
        if device == "cuda":  # the whole greedy draft of a verify step, as generate replays it
            fns[f"draft K={k} (window + K-1 steps)"] = drafter.capture(b, k).graphs[(b, k + 1, k)][0].replay
        else:
            fns[f"draft K={k} (window + K-1 steps)"] = lambda: drafter.draft(aux_w, tok_w, pos_w, k, k)
        t = interleaved(bench, fns, args.rounds)
        base = t["target decode step (T=1)"]
        for name, ms in t.items():
            print(f"{b:>5} {name:<34} {ms * 1e3:>9.1f} {ms / base * 100:>9.2f}%")
        drafting = t[f"draft K={k} (window + K-1 steps)"]
        print(f"{b:>5} adapter share: {t[f'adapter alone (T={k + 1})'] / drafting * 100:.1f}% of drafting K tokens, "
              f"{t[f'adapter alone (T={k + 1})'] / t[f'drafter window call (aux, T={k + 1})'] * 100:.1f}% of the "
              "window call")
        step_times[b] = (base, t[f"target verify pass (T=K+1={k + 1})"], drafting)

    print("\n== adapter: fc over slot-major aux [3, B, T, H] -> [B, T, H], captured ==")
    print(f"{'batch':>5} {'T':>5} " + " ".join(f"{n:>14}" for n in adapter_options(drafter)) + "   (us; ratio to addmm)")
    for b in batches:
        for t in (1, k + 1, 64 if args.tiny else 2048):
            aux = torch.randn(split.plan.n_slots, b, t, h, device=device, dtype=torch.bfloat16)
            opts = adapter_options(drafter)
            ref = opts["cat + linear"](aux).float()
            for name, fn in opts.items():
                err = (fn(aux).float() - ref).abs().max().item() / ref.abs().max().item()
                assert err < 2e-2, f"{name} disagrees with cat + linear ({err:.3g})"
            times = interleaved(bench, {n: graphed(lambda fn=fn, aux=aux: fn(aux), device) for n, fn in opts.items()},
                                args.rounds)
            base = times["addmm per tap"]
            print(f"{b:>5} {t:>5} " + " ".join(f"{v * 1e3:>8.1f} x{v / base:<4.2f}" for v in times.values()))

    print(f"\n== spec: tokens/s, K={k}, from the captured step times above ==")
    accs = [float(a) for a in args.acceptance.split(",")]
    print(f"{'batch':>5} {'plain tok/s':>11} " + " ".join(f"{f'acc {a:g}':>11}" for a in accs) + "   (speedup)")
    for b, (decode, verify, drafting) in step_times.items():
        per_step = verify + drafting
        cells = " ".join(f"{a / per_step * 1e3:>7.0f} x{decode * a / per_step:<4.2f}" for a in accs)
        print(f"{b:>5} {1e3 / decode:>11.0f} {cells}")
    print(f"(acc {TEST_ACCEPTANCE}: mean acceptance length the drafter trained in tests/test_eagle3.py reached on its "
          "tiny target; per-sequence tok/s)")

    print("\n== spec: the real generate loop, batch 1 (stages and greedy draft captured, random drafter) ==")
    prompt = torch.randint(0, 1000, (1, POSITION), device=device)
    if device == "cuda":
        split.capture(1, [POSITION, 1, k + 1])
        drafter.capture(1, k)
    runs = {}
    for name, kw in (("plain greedy", {}), (f"speculative K={k}", dict(drafter=drafter, num_draft_tokens=k,
                                                                        return_stats=True))):
        split.generate(prompt, 8, **kw)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = split.generate(prompt, args.new_tokens, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        runs[name] = (time.perf_counter() - start, out)
    plain_s = runs["plain greedy"][0]
    spec_s, (_, stats) = runs[f"speculative K={k}"]
    print(f"plain greedy: {args.new_tokens / plain_s:.0f} tok/s; speculative: {args.new_tokens / spec_s:.0f} tok/s "
          f"(mean acceptance length {stats.mean_acceptance_length:.2f}, {stats.verify_passes} verify passes, "
          f"{spec_s / stats.verify_passes * 1e3:.2f} ms per verify step incl. prefill share)")
    same = torch.equal(runs["plain greedy"][1], runs[f"speculative K={k}"][1][0])
    print(f"speculative output equals plain greedy: {same} (bf16: a K+1-token verify and a 1-token decode round "
          "differently, so a near-tie in a random model's logits can flip a token; the fp32 tests check equality)")


if __name__ == "__main__":
    main()

"""``n`` samples of one prompt through the engine: the prompt's full blocks shared among them (one prefill, then each
sample computes only the prompt's last, partial block) against ``n`` independent requests, in the same run.

Per ``(prompt length, n)``: the prompt tokens the steps computed, the most KV blocks in use at once, and the wall time
to finish all ``n`` (median of --repeats), on the demo model (fp32, 8 layers, H=256; --device cpu or cuda). Both
variants are checked to produce the same tokens (seeded sampling: sample ``j`` seeded ``seed + j``).

    python bench/n_choices.py                                   # CPU: prompts of 257 and 1025 tokens, n 4 and 16
    python bench/n_choices.py --device cuda --prompts 2049 --n 8,64
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ppsplit  # noqa: E402
from ppsplit import CacheConfig  # noqa: E402
from ppsplit.serve.engine import Engine  # noqa: E402
from ppsplit.serve.sampling import SamplingParams  # noqa: E402


def run(split, prompt: list[int], n: int, new: int, share: bool):
    """``(outputs, prompt tokens computed, most blocks in use, seconds)`` of ``n`` samples of ``prompt``."""
    engine = Engine(split, max_num_seqs=n)
    sched, computed = engine.scheduler, [0]
    schedule = sched.schedule

    def counted(*a, **kw):
        plan = schedule(*a, **kw)
        if plan is not None:
            computed[0] += sum(min(w.count, len(r.prompt) - w.position) for r, w in plan.entries
                               if not w.fed and w.position < len(r.prompt))
        return plan

    sched.schedule = counted
    params = [SamplingParams(max_tokens=new, temperature=1.0, seed=7 + j, ignore_eos=True) for j in range(n)]
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params[0])]
    ids += [engine.add_request(prompt, p, parent=ids[0] if share else None) for p in params[1:]]
    final, most = {}, 0
    while engine.has_unfinished():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        most = max(most, engine.blocks_in_use)
    if split.stages[0].parameters().__next__().device.type == "cuda":
        torch.cuda.synchronize()
    return [final[i] for i in ids], computed[0], most, time.perf_counter() - start


def main() -> None:
    from common import banner
    from ppsplit.compile.demo import demo_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--prompts", default="257,1025", help="prompt lengths (default: %(default)s)")
    p.add_argument("--n", default="4,16", help="samples per prompt (default: %(default)s)")
    p.add_argument("--new", type=int, default=16, help="tokens each sample generates (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    lengths, ns = [int(x) for x in args.prompts.split(",")], [int(x) for x in args.n.split(",")]
    if args.device == "cpu":
        torch.set_num_threads(1)
    model = demo_model().to(args.device)
    cache = CacheConfig(batch_size=max(ns), max_len=max(lengths) + args.new + 15)
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=cache), 1)
    print(banner(args.device))
    print(f"{'prompt':>7}{'n':>4}{'computed (shared / indep.)':>30}{'peak blocks':>16}{'seconds':>18}{'speedup':>9}")
    for length in lengths:
        prompt = [(31 * i) % 1000 + 3 for i in range(length)]
        for n in ns:
            rows = {}
            for share in (True, False):
                runs = [run(split, prompt, n, args.new, share) for _ in range(args.repeats)]
                rows[share] = runs[0][:3] + (statistics.median(r[3] for r in runs),)
            if rows[True][0] != rows[False][0]:
                raise SystemExit(f"prompt {length}, n {n}: the shared and independent samples differ")
            (_, c1, b1, t1), (_, c0, b0, t0) = rows[True], rows[False]
            print(f"{length:>7}{n:>4}{f'{c1} / {c0}':>30}{f'{b1} / {b0}':>16}{f'{t1:.3f} / {t0:.3f}':>18}"
                  f"{t0 / t1:>8.2f}x")


if __name__ == "__main__":
    main()

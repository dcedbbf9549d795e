"""Bytes of the sampler's per-slot state for adjusted logits (penalties, logit_bias, min_tokens), allocated at the
first adjusted request, for a cache of --slots sequence slots over a --vocab vocabulary:

    before   the issue-55 layout: output counts, prompt ids and stop ids as int32 [slots, vocab], bias float32
             [slots, vocab] (4 x 4 bytes per slot and id)
    after    what ``ppsplit.serve.Sampler`` allocates now (measured: the tensors' bytes, on the meta device): bool
             masks [slots, vocab + 1], counts int16 when a sequence holds fewer than 32768 tokens (else int32), the
             bias sparse [slots, 301] ids + values

    python bench/adjusted_state.py                      # slots 256, vocab 128256 (Llama 3), max_len 8192 and 131072
    python bench/adjusted_state.py --slots 64 --vocab 151936 --max-len 32768
"""
import argparse

import torch

from ppsplit.serve.sampler import Sampler
from ppsplit.serve.sampling import SamplingParams
from ppsplit.serve.scheduler import Admission


def measured(slots: int, vocab: int, max_len: int) -> dict[str, int]:
    """The state's bytes once a request with a penalty, a bias and min_tokens was admitted and adjusted (shapes only:
    the meta device allocates nothing)."""
    sampler = Sampler(slots, "meta", max_len=max_len)
    params = SamplingParams(max_tokens=8, presence_penalty=1.0, logit_bias={5: 1.0}, min_tokens=2)
    sampler.admit([Admission(0, params, 0, 0, (1, 2), (), (2,))])
    meta = dict(device="meta", dtype=torch.long)
    sampler.adjust(torch.empty(1, 1, vocab, device="meta"), torch.zeros(1, **meta), torch.zeros(1, 0, **meta),
                   torch.zeros(1, **meta), torch.zeros(1, **meta))
    return {name: getattr(sampler, name).nbytes for name in ("counts", "seen", "stops", "bias_ids", "bias")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--max-len", type=int, nargs="*", default=[8192, 131072])
    args = p.parse_args()
    before = 4 * args.slots * args.vocab * 4
    print(f"slots {args.slots}, vocab {args.vocab}")
    print(f"{'layout':<28}{'bytes':>14}{'MiB':>10}{'ratio':>8}  parts")
    print(f"{'before (4 x 32-bit dense)':<28}{before:>14,}{before / 2**20:>10.1f}{1:>8.2f}")
    for max_len in args.max_len:
        parts = measured(args.slots, args.vocab, max_len)
        total = sum(parts.values())
        detail = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in parts.items())
        print(f"{f'after (max_len {max_len})':<28}{total:>14,}{total / 2**20:>10.1f}{total / before:>8.2f}  {detail}")


if __name__ == "__main__":
    main()

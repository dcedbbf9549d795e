"""Fused tap kernel vs copy bandwidth, Inductor's own fusion and unfused eager (H200, bf16, H=4096).

    python bench/tap_kernel.py            # on a CUDA GPU

Per T: our kernel with and without the tap store (add + RMSNorm [+ store]), the same math compiled by Inductor
(the shared anchor's functions), and eager torch (add, HF RMSNorm, then a copy per tap). Bandwidth counts the
bytes that must move: read x, r; write s, y (+ the slot). Under a CUDA graph, per-step times for small T.
"""
import argparse
import sys

import torch
import triton

from ppsplit.triton_kernels import norm_reference
from ppsplit.triton_kernels.fused_norm import launch_tap_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import graphed  # noqa: E402

EPS = 1e-5


def add_norm(x, r, w):  # the anchor's reference (HF LlamaRMSNorm after a residual add)
    s = x + r
    v = s.float().pow(2).mean(-1, keepdim=True)
    return (w * (s.float() * torch.rsqrt(v + EPS)).to(s.dtype)), s


def add_norm_tap(x, r, w, slot):
    y, s = add_norm(x, r, w)
    slot.copy_(s)
    return y, s


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_time(fn):
    return bench(graphed(fn))


def in_graph_time(make, sets: int = 8):
    """Per-call time with ``sets`` calls on distinct buffers captured back to back in one graph: what the kernel
    costs inside a captured stage, where the graph's own launch latency is paid once for hundreds of kernels."""
    fns = [make() for _ in range(sets)]
    for fn in fns:
        fn()
    torch.cuda.synchronize()

    def all_calls():
        for fn in fns:
            fn()
    return graph_time(all_calls) / sets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", default="1,16,128,2048,8192,32768")
    args = ap.parse_args()
    H = args.hidden
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    n = 1 << 30
    a = torch.randn(n, device=dev, dtype=dt)
    b = torch.empty_like(a)
    copy_bw = 2 * a.numel() * 2 / bench(lambda: b.copy_(a)) / 1e6
    del a, b
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy: {copy_bw:.0f} GB/s (read+write)")

    c_norm = torch.compile(add_norm, dynamic=False)
    c_tap = torch.compile(add_norm_tap, dynamic=False)
    cols = ("T", "ours us", "ours+tap", "tap GB/s", "of copy", "ind us", "ind+tap", "ind+tap GB/s", "of copy",
            "eager+tap", "g ours", "g ours+tap", "g ind", "g ind+tap", "in-g ours+tap", "of copy", "in-g ind+tap",
            "of copy")
    print(" ".join(f"{c:>12}" for c in cols))
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, H, device=dev, dtype=dt)
        r = torch.randn_like(x)
        w = torch.randn(H, device=dev, dtype=dt)
        aux = torch.empty(3, T, H, device=dev, dtype=dt)
        out = (torch.empty_like(x), torch.empty_like(x))

        def ours():
            launch_tap_kernel(x, r, w, None, None, EPS, "rms", want_s=True, out=out)

        def ours_tap():
            launch_tap_kernel(x, r, w, None, aux, EPS, "rms", want_s=True, slot=1, out=out)

        # Correctness beside the timing: fused result vs the HF op sequence, and the tap slot.
        ours_tap()
        y_ref, s_ref = add_norm(x, r, w)
        assert torch.equal(out[0], s_ref) and torch.equal(aux[1], s_ref)
        err = ((out[1].float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        assert err < 1e-2, err

        t_ours, t_tap = bench(ours), bench(ours_tap)
        c_norm(x, r, w), c_tap(x, r, w, aux[1])
        t_ind, t_ind_tap = bench(lambda: c_norm(x, r, w)), bench(lambda: c_tap(x, r, w, aux[1]))
        t_eager_tap = bench(lambda: add_norm_tap(x, r, w, aux[1]))
        nb = T * H * 2
        gb_tap, gb_ind_tap = 5 * nb / t_tap / 1e6, 5 * nb / t_ind_tap / 1e6
        g = [graph_time(f) for f in (ours, ours_tap, lambda: c_norm(x, r, w), lambda: c_tap(x, r, w, aux[1]))]

        def fresh(kind):
            xs, rs = torch.randn_like(x), torch.randn_like(x)
            a, o = torch.empty_like(aux), (torch.empty_like(x), torch.empty_like(x))
            if kind == "ours":
                return lambda: launch_tap_kernel(xs, rs, w, None, a, EPS, "rms", want_s=True, slot=1, out=o)
            return lambda: c_tap(xs, rs, w, a[1])
        ig_ours, ig_ind = in_graph_time(lambda: fresh("ours")), in_graph_time(lambda: fresh("inductor"))
        row = (T, t_ours * 1e3, t_tap * 1e3, gb_tap, gb_tap / copy_bw, t_ind * 1e3, t_ind_tap * 1e3, gb_ind_tap,
               gb_ind_tap / copy_bw, t_eager_tap * 1e3, *(v * 1e3 for v in g), ig_ours * 1e3,
               5 * nb / ig_ours / 1e6 / copy_bw, ig_ind * 1e3, 5 * nb / ig_ind / 1e6 / copy_bw)
        print(" ".join(f"{v:>12.0f}" if i in (0, 3, 7) else f"{v:>12.2f}" if i in (4, 8, 15, 17) else f"{v:>12.1f}"
                       for i, v in enumerate(row)), flush=True)
    print(f"check: fused output equals the HF op sequence (s, slot exact; y rel. err < 1e-2), norm_reference "
          f"{norm_reference.__name__}")


if __name__ == "__main__":
    main()

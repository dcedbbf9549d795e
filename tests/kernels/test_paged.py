"""The paged kernels (``triton_kernels/paged.py``) against fp64 references: ragged steps of sequences at different
positions over shuffled blocks, odd sizes (head dims 64/128/256, blocks 16/32, 1..33 tokens per sequence), outputs
poisoned with NaN, the pool poisoned past every sequence's live length (a kernel that reads a stale entry returns
NaN) and padding tokens at the end.

On the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` in fp32; on a GPU the same cases run in bf16.
"""
import random

import pytest
import torch

from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
from ppsplit.triton_kernels.common import HAVE_TRITON
from ppsplit.triton_kernels import recurrent
from ppsplit.triton_kernels.attention import indexer_topk, latent_attention_reference
from ppsplit.triton_kernels.paged import (launch_paged_attention, launch_paged_conv1d, launch_paged_latent_attention,
                                          launch_paged_write, paged_attention_grouped, paged_attention_reference,
                                          paged_conv1d_reference, latent_fp8_views, paged_indexer_topk,
                                          paged_latent_attention, paged_latent_attention_reference,
                                          slot_mapping_reference)

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

# (q heads, kv heads, head dim, block size, tokens per sequence, extras)
ATTENTION_CASES = [
    (8, 2, 64, 16, (1, 7, 33), {}),                          # decode, prefill chunk, verify-sized; GQA 4
    (4, 4, 128, 32, (5, 1, 17, 2), {}),                      # MHA, blocks of 32
    (2, 1, 256, 16, (3, 1), {}),                             # head dim 256 (Gemma), GQA 2
    (4, 2, 64, 16, (9, 1, 4), dict(window=7, softcap=20.0)),  # Gemma 2: sliding window + soft-cap
    (4, 4, 64, 32, (6, 1), dict(alibi=True)),                # Bloom: ALiBi
    (4, 2, 64, 16, (5, 2, 1), dict(sinks=True, window=4)),   # gpt-oss: sinks (+ window)
    (4, 2, 64, 16, (3, 0, 0, 6, 1), {}),                     # idle slots between busy ones: no tiles of their own
    # long prefixes: whole key tiles that every row of a query tile sees run unmasked, the edges masked
    (8, 2, 64, 16, (1, 40, 5), dict(max_start=300)),
    (4, 2, 64, 16, (30, 1, 4), dict(max_start=300, window=70, softcap=20.0)),
    (4, 4, 64, 32, (6, 1), dict(max_start=200, alibi=True, sinks=True)),
    # Llama 4's chunked attention: each token over the keys of its own chunk (rows of one tile in two chunks)
    (8, 2, 64, 16, (1, 20, 5, 3), dict(chunk_size=8)),
    (4, 2, 64, 16, (30, 1, 4), dict(max_start=300, chunk_size=48)),
    (4, 2, 64, 16, (9, 1, 4), dict(chunk_size=5, window=3)),
]


def ragged(counts, block: int, slots: int, seed: int, pad: int = 3, max_start: int = 40):
    """A step of sequences ``0..len(counts)-1``, each with ``counts[s]`` tokens at a random position below
    ``max_start``, over shuffled blocks: ``(step, layout, lengths)`` (``lengths[s]``: positions 0..lengths[s]-1 of
    slot s hold live entries)."""
    rng = random.Random(seed)
    starts = [rng.randrange(0, max_start) for _ in counts]
    lengths = [p + c for p, c in zip(starts, counts)]
    per_seq = max(-(-n // block) for n in lengths)
    layout = CacheLayout(slots=slots, blocks_per_seq=per_seq, block_size=block, num_blocks=slots * per_seq + 2)
    blocks = list(range(layout.num_blocks))
    rng.shuffle(blocks)
    tables = {s: blocks[s * per_seq:(s + 1) * per_seq][:-(-lengths[s] // block)] for s in range(len(counts))}
    segments = [Segment(s, starts[s], c) for s, c in enumerate(counts) if c]
    return RaggedStep.build(segments, tables, layout, pad_to=sum(counts) + pad), layout, lengths


def pools(layout, lengths, step, kv_heads, dim, gen, dtype, device):
    """Keys and values with every live entry random and every other entry NaN."""
    shape = (layout.num_blocks, layout.block_size, kv_heads, dim)
    keys, values = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for s, n in enumerate(lengths):
        where = torch.arange(n)
        blocks, offsets = step.block_table[s, where // layout.block_size], where % layout.block_size
        keys[blocks, offsets] = torch.randn(n, kv_heads, dim, generator=gen)
        values[blocks, offsets] = torch.randn(n, kv_heads, dim, generator=gen)
    return keys.to(device, dtype), values.to(device, dtype)


def run_attention_case(case, dtype, device, tol, config=None):
    hq, hkv, dim, block, counts, extras = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(case)
    step, layout, lengths = ragged(counts, block, slots=len(counts) + 1, seed=case,
                                   max_start=extras.get("max_start", 40))
    keys, values = pools(layout, lengths, step, hkv, dim, gen, dtype, device)
    q = torch.randn(1, hq, step.num_tokens, dim, generator=gen).to(device, dtype)
    alibi = torch.rand(hq, generator=gen).to(device) * -0.5 if extras.get("alibi") else None
    sinks = torch.randn(hq, generator=gen).to(device) if extras.get("sinks") else None
    window, softcap, scale = extras.get("window", 0), extras.get("softcap", 0.0), dim ** -0.5
    chunk_size = extras.get("chunk_size", 0)
    meta = step.to(device)
    if config == "chunked":  # the keys cut into 32-position chunks, combined after; tiles of 2 tokens, first first,
        # each chunk in one masked loop
        config = dict(chunk=32, splits=-(-layout.max_len // 32), block_q=max(2, 16 // hq * hkv), block_n=32,
                      reverse=False, phases=False)
    elif config == "decode":  # one-token tiles over 32-position chunks, as a decode step takes them, the combine
        # kernel adding up the chunks and zeroing the padding
        config = dict(chunk=32, splits=-(-layout.max_len // 32), block_q=1, block_n=32, phases=False)
    elif config == "wide":  # the half-precision prefill plan's tiles (fp32 rows take 64-row tiles): 128 rows, 64 keys
        config = dict(block_q=max(1, 128 // (hq // hkv)), block_n=64, warps=8)
    elif config == "int64":  # 64-bit offsets into the pools, as pools of 2**31 elements or more take; and the three
        # key loops on every tile, decode tiles too (their plan takes one masked loop)
        config = dict(int64=True, phases=True)
    elif config == "head-major":  # pools laid out [blocks, heads, block_size, dim] underneath, read through strides
        keys, values = (t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (keys, values))
        config = None
    got = launch_paged_attention(q, keys, values, meta.positions, meta.seq, meta.block_table, meta.seq_start,
                                 meta.seq_count, scale, window, softcap, alibi, sinks, chunk_size=chunk_size,
                                 config=config)
    n = sum(counts)
    assert not got[:, :, :n].isnan().any(), "an output left unwritten, or a stale pool entry read"
    assert (got[:, :, n:] == 0).all(), "padding tokens must give zeros"
    ref = paged_attention_reference(q.double().cpu(), keys.double().cpu().nan_to_num(), values.double().cpu()
                                    .nan_to_num(), step.positions, step.seq, step.block_table, step.seq_start,
                                    step.seq_count, scale, window, softcap,
                                    None if alibi is None else alibi.double().cpu(),
                                    None if sinks is None else sinks.double().cpu(), chunk_size)
    torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_paged_attention_torch_path_groups_sequences_exactly(case):
    """The op's torch path (the sequences of a step grouped by token count, one batched attention per group over
    keys gathered to the group's longest; Llama 4's chunks too) equals the per-sequence reference in fp64, with NaN
    in every pool entry no sequence owns."""
    hq, hkv, dim, block, counts, extras = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(case)
    step, layout, lengths = ragged(counts, block, slots=len(counts) + 1, seed=case,
                                   max_start=extras.get("max_start", 40))
    keys, values = pools(layout, lengths, step, hkv, dim, gen, torch.float64, "cpu")
    q = torch.randn(1, hq, step.num_tokens, dim, generator=gen, dtype=torch.float64)
    alibi = torch.rand(hq, generator=gen, dtype=torch.float64) * -0.5 if extras.get("alibi") else None
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) if extras.get("sinks") else None
    args = (step.positions, step.block_table, step.seq_start, step.seq_count, dim ** -0.5, extras.get("window", 0),
            extras.get("softcap", 0.0), alibi, sinks, extras.get("chunk_size", 0))
    got = paged_attention_grouped(q, keys, values, *args)
    ref = paged_attention_reference(q, keys.nan_to_num(), values.nan_to_num(), step.positions, step.seq,
                                    *args[1:])
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("config", [None, "chunked", "decode", "wide", "head-major", "int64"],
                         ids=["planned", "chunked", "decode", "wide", "head-major", "int64"])
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_paged_attention_kernel_matches_fp64(case, config):
    run_attention_case(case, torch.float32, "cpu", 2e-5, config)


# MLA: (heads, latent r, rotary dr, non-rotary dn, value dv, block size, tokens per sequence, extras)
LATENT_CASES = [
    (4, 40, 24, 8, 16, 16, (1, 7, 33), {}),                # one program holds every head
    (20, 48, 8, 16, 24, 32, (5, 1, 2), {}),                # 20 heads: two programs of 10 read the one latent head
    (6, 32, 16, 8, 8, 16, (9, 1, 4), dict(window=7, softcap=20.0)),
    (4, 32, 16, 32, 16, 16, (3, 1, 5), {}),               # dn 32: two 16-row blocks of W_uk per head (FP8)
]


def run_latent_case(case, dtype, device, tol, config=None, fp8=None):
    """``fp8``: ``kv_b_proj`` quantised to FP8 in ``(block_n, block_k)`` blocks (``None`` for a one-block scale),
    its two per-head products then FP8 grouped products over views of it (``latent_fp8_views``), against the fp64
    product with its exact dequantisation."""
    heads, r, dr, dn, dv, block, counts, extras = LATENT_CASES[case]
    gen = torch.Generator().manual_seed(case)
    step, layout, lengths = ragged(counts, block, slots=len(counts) + 1, seed=case)
    latents, _ = pools(layout, lengths, step, 1, r, gen, dtype, device)
    ropes, _ = pools(layout, lengths, step, 1, dr, gen, dtype, device)
    q = torch.randn(1, heads, step.num_tokens, dn + dr, generator=gen).to(device, dtype)
    weight = torch.randn(heads * (dn + dv), r, generator=gen) / r ** 0.5
    window, softcap, scale = extras.get("window", 0), extras.get("softcap", 0.0), (dn + dr) ** -0.5
    meta = step.to(device)
    if config == "chunked":
        config = dict(chunk=32, splits=-(-layout.max_len // 32), block_q=2, block_n=32)
    views = None
    if fp8 is not None:
        from tests.artifact.test_quantized import quantize_blocks, reference_dequant

        bn, bk = fp8 if fp8 != "tensor" else weight.shape
        weight, weight_scale = quantize_blocks(weight, bn, bk)
        exact = reference_dequant(weight, weight_scale, bn, bk)
        weight, weight_scale = weight.to(device), weight_scale.to(device)
        views = latent_fp8_views(weight, weight_scale, bn, bk, heads, dn)
        assert views is not None
    else:
        weight = weight.to(device, dtype)
        exact = weight.double().cpu()
    got = launch_paged_latent_attention(q, latents, ropes, weight, dn, meta.positions, meta.seq, meta.block_table,
                                        meta.seq_start, meta.seq_count, scale, window, softcap, config=config,
                                        fp8=views)
    n = sum(counts)
    assert got.shape == (1, heads, step.num_tokens, dv)
    assert not got[:, :, :n].isnan().any(), "an output left unwritten, or a stale pool entry read"
    assert (got[:, :, n:] == 0).all(), "padding tokens must give zeros"
    ref = paged_latent_attention_reference(q.double().cpu(), latents.double().cpu().nan_to_num(),
                                           ropes.double().cpu().nan_to_num(), exact, dn, step.positions,
                                           step.seq, step.block_table, step.seq_start, step.seq_count, scale, window,
                                           softcap)
    torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("config", [None, "chunked"], ids=["planned", "chunked"])
@pytest.mark.parametrize("case", range(len(LATENT_CASES)))
def test_paged_latent_attention_kernel_matches_fp64(case, config):
    """MLA: the kernel's second key part (the rotary keys' pool) and one latent head read by every query head."""
    run_latent_case(case, torch.float32, "cpu", 2e-5, config)


@pytest.mark.parametrize("case,fp8", [(0, (8, 16)), (0, (8, 64)), (0, "tensor"), (1, "tensor"), (2, (8, 16)),
                                      (2, (8, 64)), (3, (16, 16))],
                         ids=["blocks", "one-k-block", "per-tensor", "20-heads-per-tensor", "window-softcap",
                              "window-softcap-one-k-block", "two-blocks-a-head"])
def test_paged_latent_attention_reads_an_fp8_weight_as_stored(case, fp8):
    """MLA over an FP8 ``kv_b_proj`` (DeepSeek-V3's FP8 checkpoints): each head's ``W_uk`` read transposed and its
    ``W_uv`` as they lie in the stored weight, scales included, equal the fp64 MLA over the dequantised weight."""
    run_latent_case(case, torch.float32, "cpu", 2e-5, fp8=fp8)


def test_latent_fp8_views_need_blocks_that_hold_whole_heads():
    """Row blocks that straddle a head's key and value parts (or two heads) give no views: the op dequantises."""
    weight = torch.zeros(4 * 24, 40, dtype=torch.float8_e4m3fn)  # 4 heads of dn 8 + dv 16, r 40
    assert latent_fp8_views(weight, torch.ones(12, 3), 8, 16, 4, 8) is not None
    assert latent_fp8_views(weight, torch.ones(6, 3), 16, 16, 4, 8) is None   # a block over dn and part of dv
    assert latent_fp8_views(weight, torch.ones(12, 40), 8, 1, 4, 8) is None   # 1-wide k-blocks: no tile fits
    # W_uk^T's k-blocks are the row blocks: 8 of a head's 16 key rows leave no 16-wide tile inside one
    assert latent_fp8_views(torch.zeros(20 * 40, 48, dtype=torch.float8_e4m3fn), torch.ones(100, 3), 8, 16, 20,
                            16) is None


def gathered(pool, step, slot, length):
    """Positions ``0 .. length - 1`` of sequence ``slot`` from ``pool``: ``[length, *feature]``."""
    where = torch.arange(length)
    return pool[step.block_table[slot, where // pool.shape[1]], where % pool.shape[1]]


def test_paged_indexer_picks_each_sequences_own_best_positions():
    """DSA's indexer over a ragged step: each token's picks are those of the dense ``indexer_topk`` over its own
    sequence alone (stale pool entries are NaN: reading one would poison the scores); padding tokens pick none."""
    gen = torch.Generator().manual_seed(0)
    heads, dim, topk = 3, 24, 5
    step, layout, lengths = ragged((1, 7, 3, 12), 16, slots=5, seed=1)
    keys = torch.full((layout.num_blocks, layout.block_size, dim), float("nan"))
    for s, n in enumerate(lengths):
        where = torch.arange(n)
        keys[step.block_table[s, where // 16], where % 16] = torch.randn(n, dim, generator=gen)
    q = torch.randn(1, step.num_tokens, heads, dim, generator=gen)
    weights = torch.rand(1, step.num_tokens, 1, heads, generator=gen) + 0.1
    # No ties: head 0 scores every key above 0 (and the relu of the others still matters).
    q[..., 0, 0], keys[..., 0] = 8.0, keys[..., 0].abs() + 1.0
    got = paged_indexer_topk(q, weights, keys, step.positions, step.seq, step.block_table, 0.3, topk)
    assert got.shape == (1, step.num_tokens, topk) and (got[0, sum((1, 7, 3, 12)):] == -1).all()
    for s, (start, count) in enumerate(zip(step.seq_start.tolist(), step.seq_count.tolist())):
        if not count:
            continue
        rows = slice(start, start + count)
        alone = indexer_topk(q[:, rows], weights[:, rows], gathered(keys, step, s, lengths[s])[None],
                             step.positions[rows], 0.3, topk)
        assert got[0, rows].sort(-1).values.tolist() == alone[0].sort(-1).values.tolist()


def test_sparse_latent_attention_sees_only_the_picked_positions():
    """DeepSeek-V3.2: each token attends over the positions listed for it (-1: none; a stale or future one is not
    seen), as the dense reference over its own sequence does; padding tokens give zeros."""
    heads, r, dr, dn, dv, counts = 4, 40, 8, 12, 20, (1, 7, 3)
    gen = torch.Generator().manual_seed(2)
    step, layout, lengths = ragged(counts, 16, slots=4, seed=2)
    latents, _ = pools(layout, lengths, step, 1, r, gen, torch.float64, "cpu")
    ropes, _ = pools(layout, lengths, step, 1, dr, gen, torch.float64, "cpu")
    q = torch.randn(1, heads, step.num_tokens, dn + dr, generator=gen, dtype=torch.float64)
    weight = torch.randn(heads * (dn + dv), r, generator=gen, dtype=torch.float64) / r ** 0.5
    # Distinct positions, as a top-k gives them: the token's own first (every real token sees one), then others, past
    # and future ones among them, and a -1.
    others = torch.rand(step.num_tokens, layout.max_len, generator=gen)
    others[torch.arange(step.num_tokens), step.positions] = 2.0
    picks = others.argsort(-1, descending=True)[None, :, :6]
    picks[0, :, 5] = -1
    got = paged_latent_attention(q, latents, ropes, weight, dn, step.positions, step.seq, step.block_table,
                                 step.seq_start, step.seq_count, dn ** -0.5, 0, 0.0, picks)
    n = sum(counts)
    assert (got[:, :, n:] == 0).all()
    for s, (start, count) in enumerate(zip(step.seq_start.tolist(), step.seq_count.tolist())):
        if not count:
            continue
        rows = slice(start, start + count)
        c, kr = (gathered(pool, step, s, lengths[s]).permute(1, 0, 2)[None] for pool in (latents, ropes))
        alone = latent_attention_reference(q[:, :, rows], c, kr, weight, dn, step.positions[rows], dn ** -0.5,
                                           selected=picks[:, rows])
        torch.testing.assert_close(got[:, :, rows], alone, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("layout", ["tokens", "heads", "channels", "pair"])
def test_paged_write_kernel_writes_only_real_tokens(layout):
    """Token-major values, the head-major view the keys arrive in (``k[0].transpose(0, 1)``, read through its
    strides), a convolution's ``[N, C]`` inputs, and a pair in one launch (MLA's latents and rotary keys: two
    widths)."""
    gen = torch.Generator().manual_seed(0)
    step, cache, _ = ragged((4, 1, 9), 16, slots=4, seed=3)
    slots = slot_mapping_reference(step.positions, step.seq, step.block_table, cache.block_size)
    features = {"channels": [(96,)], "pair": [(1, 80), (1, 24)]}.get(layout, [(2, 48)])
    pools, values, expected = [], [], []
    for feature in features:
        pools.append(torch.full((cache.num_blocks, cache.block_size, *feature), float("nan")))
        if layout == "heads":
            value = torch.randn(2, step.num_tokens, 48, generator=gen).transpose(0, 1)
            assert not value.is_contiguous()
        else:
            value = torch.randn(step.num_tokens, *feature, generator=gen)
        values.append(value)
        expected.append(pools[-1].clone().view(-1, *feature))
        real = slots >= 0
        expected[-1][slots[real]] = value[real]
    launch_paged_write(pools[0], values[0], slots, other=(pools[1], values[1]) if layout == "pair" else None)
    for pool, want, feature in zip(pools, expected, features):
        torch.testing.assert_close(pool.view(-1, *feature), want, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("kernel,channels", [(4, 48), (3, 300)])
def test_paged_conv1d_kernel_matches_fp64(kernel, channels):
    gen = torch.Generator().manual_seed(kernel)
    step, layout, lengths = ragged((6, 1, 3), 16, slots=4, seed=kernel)
    pool = torch.full((layout.num_blocks, layout.block_size, channels), float("nan"))
    for s, n in enumerate(lengths):
        where = torch.arange(n)
        pool[step.block_table[s, where // 16], where % 16] = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, 1, kernel, generator=gen)
    bias = torch.randn(channels, generator=gen)
    x = torch.zeros(1, channels, step.num_tokens)
    got = launch_paged_conv1d(x, weight, bias, pool, step.positions, step.seq, step.block_table)
    ref = paged_conv1d_reference(x.double(), weight.double(), bias.double(), pool.double().nan_to_num(),
                                 step.positions, step.seq, step.block_table)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)


def ragged_scan_cases(device):
    """(name, kernel, torch path, per-token args, extra) over one ragged step: a 12-token prefill (longer than the
    8-state ring) at 0, a decode token at 14, a 5-token verify window at 9, then 3 padding tokens; ring row s per
    sequence slot s, row 3 (free) untouched. The kernels' segments are (start, count, input row) per slot, as the
    ops pass them: every token is in row 0 of the step's ``[1, N, ...]`` inputs."""
    g = torch.Generator().manual_seed(0)
    step, _, _ = ragged((12, 1, 5), 16, slots=4, seed=0)
    starts, counts = [0, 14, 9], [12, 1, 5]
    positions = torch.cat([torch.arange(p, p + c) for p, c in zip(starts, counts)] + [torch.zeros(3, dtype=torch.long)])
    n = step.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    meta = (positions.to(device), step.seq_start.to(device), step.seq_count.to(device))
    def rows(a):  # (start, count, input row) per sequence slot
        return a[7], a[8], torch.zeros_like(a[7])

    yield ("gated_delta", lambda *a: recurrent.launch_gated_delta(*a[:7], True, rows(a)),
           recurrent.ragged_gated_delta_scan,
           (rand(1, n, 2, 16), rand(1, n, 2, 16), rand(1, n, 4, 24), -rand(1, n, 4).abs(), rand(1, n, 4).sigmoid()),
           rand(4, 8, 4, 16, 24), meta, (True,))
    yield ("mamba2", lambda *a: recurrent.launch_ssm_scan(*a[:7], rows(a)),
           recurrent.ragged_ssm_scan,
           (rand(1, n, 4, 8), rand(1, n, 4).abs(), -rand(4).abs(), rand(1, n, 2, 16), rand(1, n, 2, 16)),
           rand(4, 8, 4, 8, 16), meta, ())


def check_ragged_scans(device):
    for name, kernel, torch_path, args, ring, meta, extra in ragged_scan_cases(device):
        ring_ref = ring.cpu().clone()  # the torch path runs on the CPU and writes this copy
        want = torch_path(*[a.cpu() for a in args], ring_ref, *[m.cpu() for m in meta], *extra)
        got = kernel(*args, ring, *meta)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ring.cpu(), ring_ref, atol=2e-5, rtol=1e-5)


def test_ragged_scan_kernels_match_the_torch_path():
    """Each sequence starts from its own ring row at its own position and writes only that row."""
    check_ragged_scans("cpu")


@pytest.mark.gpu
def test_ragged_scan_kernels_on_gpu():
    check_ragged_scans("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, "chunked", "decode"], ids=["planned", "chunked", "decode"])
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_paged_attention_kernel_bf16_on_gpu(case, config):
    run_attention_case(case, torch.bfloat16, "cuda", 2e-2, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, "chunked"], ids=["planned", "chunked"])
@pytest.mark.parametrize("case", range(len(LATENT_CASES)))
def test_paged_latent_attention_kernel_bf16_on_gpu(case, config):
    run_latent_case(case, torch.bfloat16, "cuda", 3e-2, config)


@pytest.mark.gpu
@pytest.mark.parametrize("case,fp8", [(0, (8, 16)), (0, "tensor"), (3, (16, 16))])
def test_paged_latent_attention_fp8_weight_bf16_on_gpu(case, fp8):
    run_latent_case(case, torch.bfloat16, "cuda", 3e-2, fp8=fp8)


def test_attention_plan_chunks_long_decodes_and_tiles_prefills():
    """Decode steps get one-token tiles and chunked keys; verify steps 16-row tiles; a step holding a prefill chunk
    gets 128-row tiles (64 for wide heads) and unchunked keys."""
    from ppsplit.triton_kernels.paged import attention_plan

    decode = attention_plan(32, 32, 8, 32, 4096, 16, torch.device("cpu"))
    assert decode["block_q"] == 1 and decode["block_g"] == 4 and decode["splits"] > 1
    assert decode["chunk"] % decode["block_n"] == 0 and decode["chunk"] * decode["splits"] >= 4096
    assert not decode["phases"]  # one masked loop: fewer registers, more decode programs per SM
    assert decode["block_n"] == 32 and decode["stages"] == 3  # the H200's fastest decode tiles (RESULTS 34)
    verify = attention_plan(32, 32, 8, 8, 4096, 16, torch.device("cpu"))  # 8 sequences verifying 4 tokens
    assert verify["block_q"] * verify["block_g"] == 16 and verify["splits"] > 1 and verify["phases"]
    prefill = attention_plan(512, 32, 8, 8, 4096, 16, torch.device("cpu"))
    assert prefill["block_q"] * prefill["block_g"] == 128 and prefill["splits"] == 1 and prefill["phases"]
    wide = attention_plan(512, 16, 16, 8, 4096, 16, torch.device("cpu"), width=576)  # MLA's latent and rope parts
    assert wide["block_q"] * wide["block_g"] == 64 and wide["splits"] == 1
    fp32 = attention_plan(512, 32, 8, 8, 4096, 16, torch.device("cpu"), itemsize=4)  # twice the bytes a row
    assert fp32["block_q"] * fp32["block_g"] == 64 and fp32["block_n"] == 32
    # MLA decodes (8 programs of 16 heads a token, 576-wide keys): chunks for one program an SM, not eight
    latent = [attention_plan(b, 128, 8, b, 4160, 64, torch.device("cpu"), width=576) for b in (1, 8, 32)]
    assert [plan["chunk"] for plan in latent] == [256, 2048, 4160] and latent[2]["splits"] == 1
    assert attention_plan(1, 32, 8, 1, 4160, 64, torch.device("cpu"))["chunk"] == 64  # GQA: eight an SM

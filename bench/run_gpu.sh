#!/usr/bin/env bash
# Everything that needs the GPU, in one device call: install ppsplit there (no network: no build isolation,
# no dependencies), run the GPU tests, then the benchmarks. Logs go to $OUT.
#   bash bench/run_gpu.sh [tests] [kernel] [anchor] [pipeline] [backend] [eagle3] [balance] [pipeline_mp]
#                         [ragged] [ragged_sweep] [fp8] [fp8_sweep] [experts] [mla] [peer_decode]
#                         [peer_decode_compiled] [peer_prefill] [fused_compile] [illegal_access]
#   (default: the first four)
# GPU_TESTS: what `tests` runs (default: the whole suite's gpu-marked tests); STEP_TIMEOUT: seconds each step may run
# (default 540), so one slow step leaves the call's later steps their time. FP8_SWEEP_BATCH / FP8_SWEEP_ARGS: the
# fp8_sweep step's row counts (default "1 32") and more flags (e.g. --shapes all). The device tool returns at most 8 files
# from $OUT: every step writes one log there, the install log and the FP8 tiles go to /tmp.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT=${OUT:-/tmp/ppsplit-out} TILES=${TILES:-/tmp/ppsplit_fp8_tiles.json}
mkdir -p "$OUT"
what=${*:-tests kernel anchor pipeline}
python3 -m pip install -q --no-build-isolation --no-deps -e . >/tmp/ppsplit_install.txt 2>&1 \
  || { cat /tmp/ppsplit_install.txt; exit 1; }
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton, transformers
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}")
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,memory.used --format=csv | tee -a "$OUT/env.txt"
run_step() {
  local step=$1
  case $step in
    tests)    python3 -m pytest -q -m gpu -p no:cacheprovider -rfE ${GPU_TESTS:-tests} 2>&1 \
                | tee "$OUT/gpu_tests.txt" | tail -25 ;;
    kernel)   python3 bench/tap_kernel.py 2>&1 | tee "$OUT/tap_kernel.txt" ;;
    anchor)   [ -f .anchor/tap_anchor.py ] && python3 .anchor/tap_anchor.py 2>&1 | tee "$OUT/anchor.txt" ;;
    pipeline) python3 bench/pipeline.py 2>&1 | tee "$OUT/pipeline.txt" ;;
    backend)  python3 bench/backend.py 2>&1 | tee "$OUT/backend.txt" ;;
    eagle3)   python3 bench/eagle3.py 2>&1 | tee "$OUT/eagle3.txt" ;;
    balance)  python3 bench/balance.py --gpu 2>&1 | tee "$OUT/balance.txt" ;;
    pipeline_mp) python3 bench/pipeline_mp.py 2>&1 | tee "$OUT/pipeline_mp.txt" ;;   # 2 GPUs, NCCL (issue 9)
    ragged)   python3 bench/ragged.py --layers 8 --profile --plans 2>&1 | tee "$OUT/ragged.txt" ;;     # issue 27
    ragged_sweep) python3 bench/ragged.py --sweep 2>&1 | tee "$OUT/ragged_sweep.txt" ;;
    # issue 31; run fp8_sweep first and the step also runs on the tiles it found fastest (TILES: where they go); with
    # .hfref/hf_fp8_457.py (transformers 4.57.1's finegrained_fp8.py, carried: see bench/fp8.py) HF's FP8 step too.
    # Rows: bf16, FP8 (SiLU-and-multiply folded into the gate/up GEMV, rotary and cache writes into the q/k/v GEMV),
    # FP8 without the SiLU fold, bf16 and FP8 without the rotary fold (RESULTS section 39), and bf16 and FP8 under
    # programmatic dependent launch (their bits checked against the plain steps first). FP8_ARGS="--batch 1": the
    # batch the goals are for, in half the time
    fp8)      python3 bench/fp8.py --layers ${FP8_LAYERS:-32} --profile --pdl ${FP8_ARGS:-} \
                $( [ -f "$TILES" ] && echo --tiles "$TILES" ) \
                $( [ -f .hfref/hf_fp8_457.py ] && echo --hf-kernel .hfref/hf_fp8_457.py ) 2>&1 | tee "$OUT/fp8.txt" ;;
    experts)  python3 bench/experts.py --sweep 2>&1 | tee "$OUT/experts.txt" ;;   # issue 31: FP8 and MXFP4 MoE experts
    # issue 31: DeepSeek-V3's FP8 kv_b_proj in the MLA, with the attention's keys in other chunks than the plan's
    # beside it, and the FP8 step's kernels by GPU time at batch 1
    mla)      python3 bench/mla.py --chunks 128 256 512 1024 2048 4096 8192 --profile 2>&1 | tee "$OUT/mla.txt" ;;
    fp8_sweep) python3 bench/fp8.py --sweep --batch ${FP8_SWEEP_BATCH:-1 32} --save-tiles "$TILES" ${FP8_SWEEP_ARGS:-} \
                 $( [ -f .hfref/hf_fp8_457.py ] && echo --hf-kernel .hfref/hf_fp8_457.py ) 2>&1 \
                 | tee "$OUT/fp8_sweep.txt" ;;
    # issue 32: the defaults against HF + compile (decode at batch 1 and 32; prefill T=2048, both profiled)
    peer_decode) python3 bench/peer.py --modes decode --batches 1,32 --pp 1 --compile off --no-traced-baseline \
                   --profile-batches 1 --top 12 2>&1 | tee "$OUT/peer_decode.txt" ;;
    # ppsplit's compiled variant in a process of its own (with HF + compile, for the ratio)
    peer_decode_compiled) python3 bench/peer.py --modes decode --batches 1,32 --pp 1 --compile on \
                   --no-traced-baseline --profile-batches= 2>&1 | tee "$OUT/peer_decode_compiled.txt" ;;
    peer_prefill) python3 bench/peer.py --modes prefill --pp 1 --compile off \
                   --no-traced-baseline --profile-batches 1 --profile-hf --top 15 2>&1 | tee "$OUT/peer_prefill.txt" ;;
    # issue 32 item 2: the illegal access of fused + compiled stages (bench/RESULTS.md section 27), in its own process
    fused_compile) python3 bench/peer.py --modes prefill --pp 1 --compile on --fuse-projections on --no-hf-compile \
                   --no-traced-baseline --rounds 1 --profile-batches= --verbose 2>&1 | tee "$OUT/fused_compile.txt" ;;
    # the same, narrowed (RESULTS sections 29, 30: clean since the tap stores stopped passing slot views)
    illegal_access) for args in "" "--noview" "--first none" "--second plain" "--mode decode"; do
                   echo "--- bench/illegal_access.py $args"
                   timeout 150 python3 bench/illegal_access.py $args 2>&1 | grep -v Warning | tail -4
                 done 2>&1 | tee "$OUT/illegal_access.txt" ;;
    *)        python3 bench/pipeline.py --sections "$step" 2>&1 | tee "$OUT/pipeline_$step.txt" ;;
  esac
}
export -f run_step
for step in $what; do
  echo "=== $step"
  timeout ${STEP_TIMEOUT:-540} bash -c "run_step $step" || echo "=== $step: exit $? (124: over STEP_TIMEOUT)"
done

#!/usr/bin/env bash
# The one GPU script: correctness on 2 and all GPUs, then the benchmark suites (on all GPUs; reductions on
# 2, 4, 8; overhead on 2 and all), results under $OUT.
#   usage (GPU machine, repo root): bash scripts/gpu_suite.sh [all|quick|reductions|gemm|overhead|attention|tpmlp|moe|grouped|tune|e2e|decode|groups|nodes|p2p ...]
#     all (default): everything (on 8 GPUs longer than one 10-minute run: run the parts in turn)
#     quick: GPU tests on 2 and all GPUs, tutorials;  reductions: allgather, allreduce, reducescatter to
#     256 MiB, CUDA-graph and eager views;  gemm: the overlapped-GEMM suite;  overhead: host and eager µs
#     per call of every op against NCCL and torch's symm_mem ops;  attention: flash_decode / sp_flash_decode
#     GPU tests and bench on 1, 2 and all GPUs, Ulysses (all-to-all, fused QKV / O projections, layers) GPU
#     tests and bench on 2 and all GPUs;
#     tpmlp: torch operators / layers GPU tests on 2 and all GPUs,
#     the sequence-parallel MLP training example, and forward + backward of a TP MLP block against NCCL +
#     cuBLAS and torch async-TP;
#     moe: EP dispatch/combine, grouped GEMM, TP-MoE ops and MoE layers GPU tests on 2 and
#     all GPUs, `weft bench moe` on all GPUs;  grouped: the grouped GEMM's config sweeps on 1 GPU
#     (scripts/probe_grouped_gemm.py, bf16 and --fp8: weft's configs against torch._grouped_mm, MoE shapes;
#     scripts/probe_moe_layout.py: TP-MoE's layout kernels against torch ops; scripts/probe_moe_layers.py: the MoE
#     layers' time kernel by kernel on 1 GPU; not in all);
#     tune: the launch/tile sweeps on all GPUs (`weft tune`, its table in $OUT/tuning; scripts/probe_ep_ll.py,
#     probe_moe_tp.py; not in all);
#     e2e: the tensor-parallel decoder (weft.models): GPU tests on 2 and all GPUs (logits against transformers,
#     graph-replayed decode), `weft demo`, `weft bench e2e` (Qwen3-8B and -32B, prefill and decode, the decode
#     steps graph-replayed and eager) on all GPUs;
#     decode: one GPU against the HBM floor: the sm_90 compile of the fused decode kernels (weft/kernels/decode.py,
#     registers), tests/test_gpu_model.py on 1 GPU, scripts/bench_gemv.py (the fused GEMVs alone against
#     torch.matmul, % of copy bandwidth), scripts/probe_gemv_layout.py (plain GEMVs on a (K, N) and an (N, K)
#     weight), `weft bench -n 1 e2e` at Qwen3-8B's and Llama-3-8B's decode cases
#     b1/b8/b64 ctx 512 and b8 ctx 4096 (weft fused, layers and persistent, NCCL+cuBLAS, transformers' own model,
#     the floor), and scripts/profile_decode.py (each kernel's GPU µs per replayed step and its bytes' share of the
#     copy bandwidth) at b1 ctx 512 on the three decode paths, and the persistent one at b1 and b8 without its L2
#     prefetch and without its waits' sleep;
#     groups: tests/test_gpu_groups.py on 1 and all GPUs, examples/train_tp_dp.py, overhead rows with group=,
#     `weft bench groups` on all GPUs (the collectives and ag_gemm / gemm_rs on groups of N/2, consecutive and
#     every other rank, against NCCL on the same groups and the same op on the world);
#     nodes: tests/test_gpu_nodes_groups.py (first, in a fresh world), test_gpu_nodes.py and test_gpu_nodes_ep.py over simulated nodes (2 nodes of 1; on 4+ GPUs all GPUs as 2 nodes of N/2 and
#     as N nodes of 1): a group of some ranks made before the world's hierarchy, the hierarchical collectives, ag_gemm, gemm_rs, sp_flash_decode and the Ulysses all-to-all
#     against NCCL / torch, 1000 calls of each; then the rail over NVSHMEM (WEFT_RAIL=nvshmem): the smoke probe
#     scripts/probe_rail_nvshmem.py (each layout under its own time limit), and, where it passed, test_gpu_nodes.py
#     at the same layouts with WEFT_RAIL=nvshmem and NVSHMEM's single-host settings; `weft bench nodes` on all
#     GPUs (each op at N nodes of 1, 2 of N/2 and one of N, beside NCCL and the cost model's prediction, in one
#     report);
#     p2p: tests/test_gpu_p2p.py on 2 GPUs on the default route and with WEFT_P2P_KERNEL=1, `weft bench p2p` on
#     all GPUs (send/recv 4 KiB..256 MiB between ranks 0 and 1: weft's kernel, weft via the process group, NCCL;
#     M2N 128 x 7168 from the first half of the ranks to the rest, beside all_to_all_single and the NVLink bound), examples/disaggregated_moe.py and `weft bench disagg` on 4 GPUs
#     (2 + 2), else on 2 (1 + 1)
# WEFT_COMMIT names the commit in the log where the tree was copied without its git history.
# Logs and bench JSON/markdown/PNG end up packed in $OUT/weft_results.tar.gz (*.log, bench/).
set -uo pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/weft_out}
mkdir -p "$OUT/bench"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "== $(date -u +%FT%TZ) commit ${WEFT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo none)} gpus=$NGPU" | tee "$OUT/suite.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/suite.log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/suite.log"
status=0
step() {  # step NAME CMD...: run, log, remember failure
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/suite.log"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name rc=$rc ($((SECONDS - t0)) s)" | tee -a "$OUT/suite.log"
  [ $rc -eq 0 ] || status=1
}
PARTS=" ${*:-all} "
for part in $PARTS; do
  case "$part" in all|quick|reductions|gemm|overhead|attention|tpmlp|moe|grouped|tune|e2e|decode|groups|nodes|p2p) ;;
    *) echo "usage: $0 [all|quick|reductions|gemm|overhead|attention|tpmlp|moe|grouped|tune|e2e|decode|groups|nodes|p2p ...]" >&2; exit 2 ;; esac
done
has() { [[ "$PARTS" == *" $1 "* || "$PARTS" == *" all "* ]]; }
if has quick; then
  for n in $(printf '%s\n' 2 "$NGPU" | sort -nu); do
    [ "$n" -le "$NGPU" ] || continue
    step "gpu_tests_$n" timeout 200 python3 -m weft run -n "$n" -m pytest tests/test_gpu.py tests/test_gpu_gemm.py -m gpu -q -x -p no:cacheprovider
    step "gpu_reinit_$n" timeout 200 env WEFT_WAIT_TIMEOUT_S=30 python3 -m weft run -n "$n" -m pytest tests/test_gpu_reinit.py -m gpu -q -x -p no:cacheprovider
  done
  step tutorials timeout 360 bash -c "for t in tutorials/0*.py; do python3 -m weft run -n $NGPU \$t || exit 1; done"
fi
if has reductions; then
  # 4 KiB..256 MiB bf16, CUDA-graph replay and eager calls: 20 samples keep each run under 2 minutes.
  red=(--max-bytes $((256 << 20)) --view both --samples 20 --out "$OUT/bench")
  step bench_allgather timeout 150 python3 -m weft bench -n "$NGPU" allgather "${red[@]}"
  for n in 2 4 8; do
    [ "$n" -le "$NGPU" ] || continue
    for suite in allreduce reducescatter; do
      step "bench_${suite}_$n" timeout 150 python3 -m weft bench -n "$n" "$suite" "${red[@]}"
    done
  done
fi
if has gemm; then
  step bench_gemm timeout 400 python3 -m weft bench -n "$NGPU" gemm --samples 20 --out "$OUT/bench"
fi
if has overhead; then
  for n in $(printf '%s\n' 2 "$NGPU" | sort -nu); do
    [ "$n" -le "$NGPU" ] || continue
    step "bench_overhead_$n" timeout 150 python3 -m weft bench -n "$n" overhead --samples 20 --out "$OUT/bench"
  done
fi
if has attention; then
  for n in $(printf '%s\n' 1 2 "$NGPU" | sort -nu); do
    [ "$n" -le "$NGPU" ] || continue
    step "gpu_attention_tests_$n" timeout 300 python3 -m weft run -n "$n" -m pytest tests/test_gpu_attention.py -m gpu -q -x -p no:cacheprovider
  done
  step bench_attention_1 timeout 300 python3 -m weft bench -n 1 attention --out "$OUT/bench"
  step bench_attention_sp_2 timeout 240 python3 -m weft bench -n 2 attention --ops sp --out "$OUT/bench"
  for n in $(printf '%s\n' 2 "$NGPU" | sort -nu); do
    [ "$n" -le "$NGPU" ] || continue
    step "gpu_ulysses_tests_$n" timeout 300 python3 -m weft run -n "$n" -m pytest tests/test_gpu_ulysses.py -m gpu -q -x -p no:cacheprovider
    step "bench_ulysses_$n" timeout 300 python3 -m weft bench -n "$n" ulysses --out "$OUT/bench"
  done
fi
if has tpmlp; then
  for n in $(printf '%s\n' 2 "$NGPU" | sort -nu); do
    [ "$n" -le "$NGPU" ] || continue
    step "gpu_torch_ops_tests_$n" timeout 400 python3 -m weft run -n "$n" -m pytest tests/test_gpu_torch_ops.py -m gpu -q -x -p no:cacheprovider
  done
  step train_tp_mlp timeout 200 python3 -m weft run -n "$NGPU" examples/train_tp_mlp.py --dim 1024 --hidden 4096 --tokens 4096 --steps 300
  step bench_tpmlp timeout 500 python3 -m weft bench -n "$NGPU" tpmlp --samples 20 --out "$OUT/bench"
fi
if has moe; then
  for n in $(printf '%s\n' 2 "$NGPU" | sort -nu); do
    [ "$n" -le "$NGPU" ] || continue
    step "gpu_moe_tests_$n" timeout 400 env WEFT_WORKSPACE_BYTES=$((1 << 30)) WEFT_HEAP_SIZE=$((8 << 30)) python3 -m weft run -n "$n" -m pytest tests/test_gpu_moe.py -m gpu -q -x -p no:cacheprovider
  done
  step bench_moe timeout 540 python3 -m weft bench -n "$NGPU" moe --out "$OUT/bench"
fi
if [[ "$PARTS" == *" grouped "* ]]; then  # a tuning sweep, not a benchmark of record: only when named
  step probe_grouped_gemm timeout 280 env OUT="$OUT/bench" CUDA_VISIBLE_DEVICES=0 python3 scripts/probe_grouped_gemm.py --budget-s 150
  step probe_grouped_gemm_fp8 timeout 280 env OUT="$OUT/bench" CUDA_VISIBLE_DEVICES=0 python3 scripts/probe_grouped_gemm.py --fp8 --budget-s 150
  step probe_moe_layout timeout 120 env OUT="$OUT/bench" CUDA_VISIBLE_DEVICES=0 python3 scripts/probe_moe_layout.py
  step probe_moe_layers timeout 300 env OUT="$OUT/bench" python3 -m weft run -n 1 scripts/probe_moe_layers.py \
    --layers ep,ep-fp8,ep-ht,ep-ht-fp8,tp,tp-overlap,tp-baseline
fi
if [[ "$PARTS" == *" tune "* ]]; then  # tuning sweeps, like grouped
  step tune timeout 600 env WEFT_TUNING_DIR="$OUT/tuning" python3 -m weft tune -n "$NGPU"
  for probe in ep_ll moe_tp; do
    step "probe_$probe" timeout 300 env OUT="$OUT/bench" python3 -m weft run -n "$NGPU" "scripts/probe_$probe.py"
  done
fi
if has e2e; then
  for n in $(printf '%s\n' 2 "$NGPU" | sort -nu); do
    [ "$n" -le "$NGPU" ] || continue
    step "gpu_model_tests_$n" timeout 150 python3 -m weft run -n "$n" -m pytest tests/test_gpu_model.py -m gpu -q -x -p no:cacheprovider
  done
  step demo timeout 150 python3 -m weft demo
  step bench_e2e timeout 420 python3 -m weft bench -n "$NGPU" e2e --samples 10 --prefill-samples 3 --out "$OUT/bench"
fi
if has groups; then
  # Every family with group= on the layouts the GPU count allows (1: the world and groups of one; 2+: pairs,
  # groups of every other rank, a torch ProcessGroup), the TP x DP training example, `weft bench groups` (groups of
  # N/2 against NCCL on the same groups), and the overhead rows of a group beside the world ("weft group") and of a
  # group of one (-n 1) against NCCL's own call.
  for n in $(printf '%s\n' 1 "$NGPU" | sort -nu); do
    step "gpu_groups_$n" timeout 240 python3 -m weft run -n "$n" -m pytest tests/test_gpu_groups.py -m gpu -q -x -p no:cacheprovider
  done
  if [ "$NGPU" -ge 2 ]; then
    step train_tp_dp timeout 120 python3 -m weft run -n "$NGPU" examples/train_tp_dp.py --tp "$((NGPU / 2))" --steps 50
    step "bench_groups_$NGPU" timeout 200 python3 -m weft bench -n "$NGPU" groups --out "$OUT/bench"
  fi
  for n in $(printf '%s\n' 1 "$NGPU" | sort -nu); do
    step "bench_overhead_groups_$n" timeout 200 python3 -m weft bench -n "$n" overhead \
      --ops all_reduce,all_gather,reduce_scatter,broadcast,device_barrier,gemm_ar --samples 15 --out "$OUT/bench"
  done
fi
if has nodes && [ "$NGPU" -ge 2 ]; then
  for layout in $(printf '%s\n' 2:1 "$NGPU:$((NGPU / 2))" "$NGPU:1" | awk '!seen[$0]++'); do
    n=${layout%:*} local=${layout#*:}
    [ "$n" -ge 2 ] && [ "$local" -lt "$n" ] || continue
    step "gpu_nodes_${n}_local_$local" timeout 240 python3 -m weft run -n "$n" --local-world-size "$local" \
      -m pytest tests/test_gpu_nodes_groups.py tests/test_gpu_nodes.py tests/test_gpu_nodes_ep.py -m gpu -q -x \
      -p no:cacheprovider
  done
  # The rail over NVSHMEM: the smoke probe first (a hang costs one layout's limit), the tests only where it passed.
  layouts=$(printf '%s\n' 2:1 "$NGPU:1" "$NGPU:$((NGPU / 2))" | awk '!seen[$0]++' | paste -sd, -)
  before=$status
  status=0
  step probe_rail_nvshmem timeout 600 python3 scripts/probe_rail_nvshmem.py --layouts "$layouts" --timeout 150
  if [ $status -eq 0 ]; then
    for layout in ${layouts//,/ }; do
      n=${layout%:*} local=${layout#*:}
      step "gpu_nodes_nvshmem_${n}_local_$local" timeout 300 env WEFT_RAIL=nvshmem NVSHMEM_REMOTE_TRANSPORT=none \
        NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_CUDA_VMM=1 python3 -m weft run -n "$n" \
        --local-world-size "$local" -m pytest tests/test_gpu_nodes.py -m gpu -q -x -p no:cacheprovider
    done
  fi
  [ $before -eq 0 ] || status=1
  # Three worlds in one run (one per layout), each compiling and making its heaps: more than a one-world suite.
  step "bench_nodes_$NGPU" timeout 400 python3 -m weft bench -n "$NGPU" nodes --out "$OUT/bench"
fi
if has p2p && [ "$NGPU" -ge 2 ]; then
  step gpu_p2p_tests_2 timeout 200 python3 -m weft run -n 2 -m pytest tests/test_gpu_p2p.py -m gpu -q -x -p no:cacheprovider
  step gpu_p2p_kernel_tests_2 timeout 200 env WEFT_P2P_KERNEL=1 python3 -m weft run -n 2 -m pytest tests/test_gpu_p2p.py -m gpu -q -x -p no:cacheprovider
  step "bench_p2p_$NGPU" timeout 400 python3 -m weft bench -n "$NGPU" p2p --samples 20 --out "$OUT/bench"
  disagg=$([ "$NGPU" -ge 4 ] && echo 4 || echo 2)
  step "disaggregated_moe_$disagg" timeout 300 python3 -m weft run -n "$disagg" examples/disaggregated_moe.py
  step "bench_disagg_$disagg" timeout 400 python3 -m weft bench -n "$disagg" disagg --out "$OUT/bench"
fi
if has decode; then  # one GPU: bench/bench_gemv.json, bench/e2e_1.{json,md,png}, bench/profile_decode_*.json
  step compile_decode timeout 240 env WEFT_BACKEND=cuda python3 -m weft.testing.compile 90 decode decode_step \
    --registers
  step gpu_model_tests_1 timeout 200 env CUDA_VISIBLE_DEVICES=0 python3 -m weft run -n 1 -m pytest \
    tests/test_gpu_model.py -m gpu -q -x -p no:cacheprovider
  step bench_gemv timeout 200 env CUDA_VISIBLE_DEVICES=0 python3 -m weft run -n 1 scripts/bench_gemv.py \
    --out "$OUT/bench/bench_gemv.json"
  step probe_gemv_layout timeout 200 env CUDA_VISIBLE_DEVICES=0 python3 -m weft run -n 1 \
    scripts/probe_gemv_layout.py --out "$OUT/bench/probe_gemv_layout.json"
  step bench_e2e_decode_1 timeout 480 env CUDA_VISIBLE_DEVICES=0 python3 -m weft bench -n 1 e2e \
    --models Qwen3-8B,Llama-3-8B --prefill none --decode 1x512,8x512,64x512,8x4096 --samples 20 --out "$OUT/bench"
  for path in fused layers persistent; do
    step "profile_decode_b1_ctx512_$path" timeout 200 env CUDA_VISIBLE_DEVICES=0 python3 -m weft run -n 1 \
      scripts/profile_decode.py --batch 1 --context 512 --path "$path" \
      --out "$OUT/bench/profile_decode_b1_ctx512_$path.json"
  done
  for batch in 1 8; do
    step "profile_decode_b${batch}_ctx512_persistent_no_prefetch" timeout 200 env CUDA_VISIBLE_DEVICES=0 \
      python3 -m weft run -n 1 scripts/profile_decode.py --batch "$batch" --context 512 --path persistent \
      --prefetch-rows 0 --out "$OUT/bench/profile_decode_b${batch}_ctx512_persistent_no_prefetch.json"
    step "profile_decode_b${batch}_ctx512_persistent_no_wait_sleep" timeout 200 env CUDA_VISIBLE_DEVICES=0 \
      python3 -m weft run -n 1 scripts/profile_decode.py --batch "$batch" --context 512 --path persistent \
      --wait-backoff-ns 0 --out "$OUT/bench/profile_decode_b${batch}_ctx512_persistent_no_wait_sleep.json"
  done
fi
cat "$OUT"/bench/*.md 2>/dev/null
# One archive instead of many files: one file to copy back from the GPU machine.
pack=$(mktemp -d)
tar czf "$pack/weft_results.tar.gz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$pack/weft_results.tar.gz" "$OUT/"
exit $status

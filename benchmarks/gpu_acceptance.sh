#!/usr/bin/env bash
# The GPU checks and measurements a CUDA host owes us, in one run: the GPU tests, then the
# benchmarks whose numbers `benchmarks/README.md` reports, each step under its own time limit
# and all of them under BUDGET_S, with each step's whole log in OUT. What a platform engineer
# runs on a new host, and what a session with a short lease on one runs first: a step that
# hangs costs its limit, not the lease, and the summary says which steps ran. The exit
# status is 1 if a step failed or was stopped at its limit, 0 if every step that ran passed.
# Last, everything in OUT is packed into OUT/logs.tar.gz.
#
#   benchmarks/gpu_acceptance.sh [STEP...]   default: every step below but routing, in order
#   OUT=runs/gpu-acceptance                  where the logs go
#   BUDGET_S=1500                            a step starts only with half its limit left
#   LANES=1                                  one-GPU steps at once, one lane a GPU (below)
#
# Steps (GPUs needed; limit):
#   tests       the one-GPU engine tests: tests/gpu (but the kernel files) and the bf16
#               integration ones (1; 540 s)
#   tests-kernels  the Triton kernels' bf16 tests in tests/gpu, each variant compiled (1; 480 s)
#   tests-nccl  tests/gpu/test_parallel_nccl.py: TP, PP, TP x PP, fused all-reduce (2; 560 s)
#   decode      gemv_sweep.py (the one-row Linear against cuBLAS), then decode.py: ceiling,
#               Coxswain, without the norms and activation folded into the GEMV launches
#               (unfused), on cuBLAS alone (gemv off), with gemv at every shape, and with
#               fused_decode_attention; Qwen3-0.6B and Llama-3-8B, batch 1/8/32/128
#               (1; 360 s)
#   profile     profile_decode.py's kernel table, host stages and host functions (plain, and
#               with per-token capture), and the Llama-3-8B batch-256 step (1; 260 s)
#   steering    steering_overhead.py, 128 x 512 -> 64, all 28 layers, K = 1 and 128 (1; 240 s)
#   capture     host_copy.py on this host (the Llama-3-8B batch-128 block), then
#               steering_overhead.py's capture rows at batch 32 and 128 (Qwen3-0.6B shape;
#               128 also with --capture-arena-bytes 0, the drain's way) and at 128
#               (Llama-3-8B shape), K = 1 (1; 460 s)
#   tp          decode.py --parallel 2x1u,2x1,2x1c,1x2 on the Llama-3-8B shape (2; 300 s;
#               2x1 fuses each all-reduce with its norm by default, 2x1u keeps them apart,
#               2x1c turns gemv off)
#   70b         decode.py, Llama-3-70B shape at TP=4 and TP=4 fused, steered and captured (4; 600 s)
#   routing     only when named: the routing study's device headline, 8 runs a GPU
#               (ROUTING_JOBS=N: N runs at once, over all the GPUs), resumed
#               into ROUTING_JSONL (default docs/routing_study/device-carry.jsonl, copied
#               into OUT after: put it back there before the next run) for the rest of the
#               budget (1; what is left)
# All the default steps take about 50 minutes on four GPUs (BUDGET_S=3000). One-GPU steps run
# on the first GPU CUDA_VISIBLE_DEVICES names (GPU 0 without it). A step whose GPUs the host
# lacks is skipped, and says so. Run from the repository root with the dependencies
# importable (`deploy/offline/install.sh` on a host without internet). Ctrl-C stops the
# step running and the run.
#
# LANES=1 on a host of several GPUs runs the one-GPU steps asked for at the same time, in a
# lane a GPU (this script again, with OUT/gpuN), the longest first onto the lane with the
# least to do; then the other steps, in order. Four GPUs take the one-GPU steps in about
# the time of the busiest lane (tests alone; profile and steering share one). The lanes
# share the host's CPU, so a host-bound number measured
# this way may read worse than on a quiet host: time the step alone for one you report.
set -uo pipefail

STEPS=(tests tests-kernels tests-nccl decode profile steering capture tp 70b routing)
OUT=${OUT:-runs/gpu-acceptance}
BUDGET_S=${BUDGET_S:-1500}
steps=("$@")
((${#steps[@]})) || steps=("${STEPS[@]:0:${#STEPS[@]}-1}")
for s in "${steps[@]}"; do
    [[ " ${STEPS[*]} " == *" $s "* ]] || { echo "unknown step $s (${STEPS[*]})" >&2; exit 2; }
done
mapfile -t steps < <(printf '%s\n' "${steps[@]}" | awk '!seen[$0]++')  # each step once
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())') || {
    echo "gpu_acceptance.sh: python3 cannot import torch" >&2
    exit 2
}
first=${CUDA_VISIBLE_DEVICES:-0}
one="CUDA_VISIBLE_DEVICES=${first%%,*}"  # one-GPU steps: the first visible GPU
start=$SECONDS
summary=()
failed=0
interrupted=0

# The one-GPU steps and their limits (`run` reads them here), for LANES.
declare -A ONE_GPU=(
    [tests]=540 [tests-kernels]=480 [decode]=360 [profile]=260 [steering]=240 [capture]=460
)
# The kernel test files (`tests-kernels`); `tests` runs the rest of tests/gpu.
KERNEL_TESTS=(tests/gpu/test_fused_kernels_bf16.py tests/gpu/test_patch_kernel_bf16.py
    tests/gpu/test_steer_kernel_bf16.py)

# lanes: run the one-GPU steps of `steps` in a lane a GPU, and leave the rest in `steps`.
# Lane N (OUT/gpuN) runs on the Nth GPU this process sees (its id in CUDA_VISIBLE_DEVICES).
lanes() {
    local ids s i best lane
    IFS=, read -ra ids <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}"
    ids=("${ids[@]:0:gpus}")  # a listed id torch does not see gets no lane
    local -a load=() todo=() pids=() lane_of=() rest=()
    for i in "${!ids[@]}"; do load[i]=0; todo[i]=""; done
    # longest first, each onto the lane with the least to do
    for s in $(for s in "${steps[@]}"; do
        [[ -n ${ONE_GPU[$s]:-} ]] && echo "${ONE_GPU[$s]} $s"
    done | sort -rn | cut -d' ' -f2); do
        best=0
        for i in "${!ids[@]}"; do ((load[i] < load[best])) && best=$i; done
        load[best]=$((load[best] + ONE_GPU[$s]))
        todo[best]+=" $s"
    done
    for s in "${steps[@]}"; do [[ -z ${ONE_GPU[$s]:-} ]] && rest+=("$s"); done
    trap 'kill -TERM "${pids[@]}" 2>/dev/null; interrupted=1' INT TERM
    for i in "${!ids[@]}"; do
        [[ -z ${todo[i]} ]] && continue
        local mine=()  # in the order asked
        for s in "${steps[@]}"; do [[ " ${todo[i]} " == *" $s "* ]] && mine+=("$s"); done
        echo "== lane gpu$i (CUDA_VISIBLE_DEVICES=${ids[i]}): ${mine[*]} (log: $OUT/gpu$i.txt)"
        rm -f "$OUT/gpu$i/summary.txt"  # an earlier run's, which a lane that dies would leave
        LANES= CUDA_VISIBLE_DEVICES=${ids[i]} OUT="$OUT/gpu$i" BUDGET_S=$BUDGET_S \
            bash "$0" "${mine[@]}" >"$OUT/gpu$i.txt" 2>&1 &
        pids+=($!)
        lane_of+=("$i")
    done
    local -a rcs=()
    for i in "${!pids[@]}"; do
        wait "${pids[i]}"
        rcs[i]=$?
    done
    if ((interrupted)); then  # the trap cut a wait short: wait for every lane to stop
        for i in "${!pids[@]}"; do
            wait "${pids[i]}"
            rcs[i]=$?
        done
    fi
    trap - INT TERM
    for i in "${!pids[@]}"; do
        ((rcs[i] != 0)) && failed=1
        lane="$OUT/gpu${lane_of[i]}/summary.txt"
        if [[ -f $lane ]]; then
            while IFS= read -r s; do summary+=("gpu${lane_of[i]} $s"); done <"$lane"
        else
            summary+=("gpu${lane_of[i]}:${todo[lane_of[i]]}: the lane ended (rc ${rcs[i]}) without a summary")
        fi
    done
    steps=("${rest[@]}")
}
noise='TCPStore|frame #|Exception raised|ProcessGroupNCCL.cpp|^$'

# step NAME GPUS LIMIT_S CMD...: run CMD with its output in OUT/NAME.log, then print its tail.
step() {
    local name=$1 need=$2 limit=$3
    shift 3
    local left=$((BUDGET_S - (SECONDS - start)))
    if ((gpus < need)); then
        summary+=("$name: skipped (needs $need GPUs, this host has $gpus)")
        return
    fi
    if ((left < limit / 2 || left < 30)); then
        summary+=("$name: skipped (${left} s of the ${BUDGET_S} s budget left, it may take ${limit})")
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s)"
    local t0=$SECONDS
    # In the background so a Ctrl-C reaches it: timeout runs it in a process group of its own
    # and passes a TERM on; -k kills what ignores the TERM 30 s later.
    timeout -k 30 "$limit" "$@" >"$OUT/$name.log" 2>&1 &
    local pid=$!
    trap 'kill -TERM "$pid" 2>/dev/null; interrupted=1' INT TERM
    wait "$pid"
    local rc=$?
    if ((interrupted)); then  # the trap cut the wait short: wait for the step to stop
        wait "$pid"
        rc=$?
    fi
    trap - INT TERM
    grep -v -E "$noise" "$OUT/$name.log" | tail -n 25
    local how="rc $rc"
    ((rc == 124)) && how="stopped at its limit"
    ((rc != 0)) && failed=1
    summary+=("$name: $how, $((SECONDS - t0)) s (log: $OUT/$name.log)")
}

# Each part of a step runs even if one before it failed; the step fails if any did.
both='rc=0; for c in "$@"; do bash -c "$c" || rc=$?; done; exit $rc'

run() {
    case $1 in
    tests)  # -v: a step stopped at its limit still names every test that failed before
        step tests 1 "${ONE_GPU[tests]}" env "$one" python3 -m pytest -v -rfE tests/gpu \
            --deselect tests/gpu/test_parallel_nccl.py "${KERNEL_TESTS[@]/#/--deselect=}" \
            tests/integration/test_oracle_bf16.py tests/integration/test_steering_bf16.py ;;
    tests-kernels)
        step tests-kernels 1 "${ONE_GPU[tests-kernels]}" env "$one" python3 -m pytest -v -rfE \
            "${KERNEL_TESTS[@]}" ;;
    tests-nccl)
        step tests-nccl 2 560 python3 -m pytest -q tests/gpu/test_parallel_nccl.py ;;
    decode)
        local d="$one python3 benchmarks/decode.py --batch-sizes 1,8,32,128"
        d+=" --systems ceiling,coxswain,coxswain-unfused,coxswain-cublas,coxswain-gemv,coxswain-fa"
        step decode 1 "${ONE_GPU[decode]}" bash -c "$both" decode \
            "$one python3 benchmarks/gemv_sweep.py" "$d --shape qwen3-0.6b" \
            "$d --shape llama3-8b" ;;
    profile)
        step profile 1 "${ONE_GPU[profile]}" bash -c "$both" profile \
            "$one python3 benchmarks/profile_decode.py --batch-sizes 1,32,128 \
                --cprofile $(printf %q "$OUT/host")" \
            "$one python3 benchmarks/profile_decode.py --batch-sizes 32,128 --capture \
                --cprofile $(printf %q "$OUT/host")" \
            "$one python3 benchmarks/decode.py --shape llama3-8b --systems coxswain \
                --batch-sizes 256 --profile $(printf %q "$OUT/profile-b256")" ;;
    steering)
        step steering 1 "${ONE_GPU[steering]}" env "$one" python3 benchmarks/steering_overhead.py \
            --layers 28 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 3072 \
            --vocab 151936 --num-seqs 128 --prompt-len 512 --output-len 64 \
            --max-num-batched-tokens 16384 --skip-hf --repeats 2 --ks 1,128 \
            --steer-layers "$(seq -s, 0 27)" --decode-steps 64 --profile "$OUT/profile-steering" ;;
    capture)
        local so="$one python3 benchmarks/steering_overhead.py --prompt-len 512 --output-len 48"
        so+=" --skip-hf --repeats 2 --ks 1 --decode-steps 32 --adapters 0"
        local qwen="--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --intermediate 3072"
        qwen+=" --vocab 151936"
        local llama="--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336"
        llama+=" --vocab 128256 --gpu-memory-utilization 0.8"
        step capture 1 "${ONE_GPU[capture]}" bash -c "$both" capture \
            "python3 benchmarks/host_copy.py --tokens 128 --layers 32 --hidden 4096" \
            "$so $qwen --num-seqs 32" \
            "$so $qwen --num-seqs 128" \
            "$so $qwen --num-seqs 128 --capture-arena-bytes 0" \
            "$so $llama --num-seqs 128 --profile $(printf %q "$OUT/profile-capture")" ;;
    tp)
        step tp 2 300 python3 benchmarks/decode.py --shape llama3-8b --systems coxswain \
            --batch-sizes 1,32,128 --parallel 2x1u,2x1,2x1c,1x2 ;;
    70b)
        step 70b 4 600 python3 benchmarks/decode.py --shape llama3-70b --systems none \
            --parallel 4x1,4x1f --batch-sizes 1,32 --steps 32 --interventions ;;
    routing)
        local records=${ROUTING_JSONL:-docs/routing_study/device-carry.jsonl}
        local rest=$((BUDGET_S - (SECONDS - start)))
        step routing 1 $((rest > 60 ? rest : 60)) python3 benchmarks/routing_study.py \
            --env checksum-carry --device cuda --jobs "${ROUTING_JOBS:-$((8 * gpus))}" --resume \
            --base docs/routing_study/bases/checksum-carry --jsonl "$records"
        # The records so far, beside the logs (the study is stopped at the budget, mid-run).
        if [ -f "$records" ]; then cp "$records" "$OUT/"; fi ;;
    esac
}

nvidia-smi -L 2>/dev/null
[[ ${LANES:-} == 1 ]] && ((gpus > 1)) && lanes
for s in "${steps[@]}"; do
    ((interrupted)) && summary+=("$s: not started (interrupted)") && continue
    run "$s"
done
echo "== summary ($((SECONDS - start)) s of a ${BUDGET_S} s budget)"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
# Every log and profile in one file, for a ticket or a copy off the host.
packed=$(mktemp) && tar -czf "$packed" --exclude logs.tar.gz -C "$OUT" . &&
    mv "$packed" "$OUT/logs.tar.gz" && echo "logs: $OUT/logs.tar.gz"
((interrupted || failed)) && exit 1
exit 0

#!/usr/bin/env bash
# The prepared check for a lent GPU machine (under 8 minutes): PPO on Qwen2.5-0.5B's shape for a
# few iterations (time split, peak GPU memory), then, if time allows, one iteration of the
# guide's Mistral-7B recipe shape in 4-bit NF4 (peak GPU memory against the guide's ~20 GB).
# On a machine with two GPUs or more it also runs the Qwen shape under DeepSpeed ZeRO-3 on two
# GPUs (recipes/accelerate/deepspeed_zero3.yaml), the sharded path the CPU tests prove.
# Each result holds `rlhf plan`'s estimate beside the measured peak (planned_peak_gib,
# measured_peak_gib: max_memory_allocated, plan_gap) for PPO and the bf16 / fp16 merges.
# Usage (device tool): bash bench/gpu_check.sh
#   → $OUT/gpu_check_{qwen,qwen_vllm,qwen_server_async0,qwen_server_async1,qwen_server_nccl,paths,mistral,zero3}.json
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q --upgrade pip
.venv-gpu/bin/python -c "import torch" 2>/dev/null || .venv-gpu/bin/pip install -q torch
.venv-gpu/bin/pip install -q -e .
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 RLHF_CLI_CACHE="$PWD/.cache/rlhf-cli"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 240 .venv-gpu/bin/python bench/gpu_check.py qwen0.5b --iterations 3 \
  --out "$out/gpu_check_qwen.json"
# the same Qwen shape with the vLLM rollout engine (tokens/s, iteration time, peak memory)
if .venv-gpu/bin/pip install -q vllm; then
  timeout 240 .venv-gpu/bin/python bench/gpu_check.py qwen0.5b --iterations 3 --backend vllm \
    --out "$out/gpu_check_qwen_vllm.json" || echo "the vLLM run failed or did not finish"
fi
# the same shape rolling out on a vLLM server (`rlhf serve`, a third of the same GPU), then with
# async_steps 1: iteration time, generated tokens/s, the trainer's peak memory without an engine
if .venv-gpu/bin/python -c "import vllm" 2>/dev/null; then
  work="$(mktemp -d)"
  url="http://127.0.0.1:8100"
  server_recipe="$(.venv-gpu/bin/python bench/gpu_check.py qwen0.5b --iterations 3 \
    --backend vllm_server --server-url "$url" --recipe-to "$work")"
  .venv-gpu/bin/rlhf serve --recipe "$server_recipe" --port 8100 --gpu-memory-utilization 0.3 \
    > "$work/serve.out" 2>&1 &
  serve_pid=$!
  if timeout 240 bash -c "until grep -q 'rlhf ppo --set' '$work/serve.out'; do sleep 2; done"; then
    for steps in 0 1; do
      timeout 200 .venv-gpu/bin/rlhf ppo --recipe "$server_recipe" --json --quiet \
        --set run.name="gpu-server-async$steps" --set ppo.generation.async_steps="$steps" \
        --set ppo.generation.tis_cap=2.0 > "$out/gpu_check_qwen_server_async$steps.json" \
        || echo "the server run (async_steps $steps) failed or did not finish"
    done
  else
    echo "rlhf serve did not answer:"; tail -5 "$work/serve.out"
  fi
  kill -TERM "$serve_pid" 2>/dev/null; wait "$serve_pid" || true
  # full weights (no LoRA) sent GPU to GPU over vLLM's NCCL weight transfer (rlhf serve adds
  # --weight-transfer-config for a full-weight recipe on CUDA): the sync's time and the mismatch
  full=(--set model.lora.enabled=false --set ppo.generation.server.sync=weights
        --set 'ppo.generation.server.urls=["http://127.0.0.1:8101"]')
  .venv-gpu/bin/rlhf serve --recipe "$server_recipe" "${full[@]}" --port 8101 \
    --gpu-memory-utilization 0.3 > "$work/serve-nccl.out" 2>&1 &
  serve_pid=$!
  if timeout 240 bash -c "until grep -q 'rlhf ppo --set' '$work/serve-nccl.out'; do sleep 2; done"; then
    timeout 200 .venv-gpu/bin/rlhf ppo --recipe "$server_recipe" "${full[@]}" --json --quiet \
      --set run.name=gpu-server-nccl --set ppo.generation.server.weight_transfer=nccl \
      > "$out/gpu_check_qwen_server_nccl.json" || echo "the NCCL weight-transfer run failed"
  else
    echo "rlhf serve (full weights) did not answer:"; tail -5 "$work/serve-nccl.out"
  fi
  kill -TERM "$serve_pid" 2>/dev/null; wait "$serve_pid" || true
fi
# 4-bit LoRA SFT, PPO on it, bf16 and fp16 merges (the paths every CPU test runs in float32)
timeout 240 .venv-gpu/bin/python bench/gpu_check.py qwen0.5b --paths \
  --out "$out/gpu_check_paths.json" || echo "the 4-bit SFT / merge paths failed or did not finish"
timeout 300 .venv-gpu/bin/python bench/gpu_check.py mistral7b --out "$out/gpu_check_mistral.json" \
  || echo "mistral7b did not finish in time; the qwen0.5b figures are in $out"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  .venv-gpu/bin/pip install -q deepspeed
  work="$(mktemp -d)"
  zero3_recipe="$(.venv-gpu/bin/python bench/gpu_check.py qwen0.5b --iterations 3 --recipe-to "$work")"
  timeout 300 .venv-gpu/bin/accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml \
    --num_processes 2 -m rlhf_cli.cli ppo --recipe "$zero3_recipe" --json > "$out/gpu_check_zero3.json" \
    || echo "the two-GPU ZeRO-3 run failed or did not finish; see the output above"
fi

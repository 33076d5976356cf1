#!/usr/bin/env bash
# The CLI on a GPU: the tiny preset through `vlrl sft` / `vlrl rl` with model.device=cuda, each recipe family the
# update path branches on (sync GRPO; async GRPO; PPO's critic; LoRA; a KL loss term with a reference; SFT) — a few
# steps each, the run's exit status and its last metrics line kept. What docs/gpu.md's "the CLI on CUDA" rows
# come from. On a lent GPU, after gpu_check's set-up (docs/gpu.md):  bash benchmarks/gpu_cli.sh /tmp/gpu_cli
# (one line per run on stdout; each run's whole log in that folder). Here, DEVICE=cpu runs the same commands on
# this machine (each ~10 s).
set -u
out=${1:-/tmp/gpu_cli}; device=${DEVICE:-cuda}; mkdir -p "$out"
small=(train.steps=2 train.prompts_per_step=4 rollout.n=4 data.n_train=16 data.n_test=4 eval.samples=1 report.html=false)
run() {  # name, then the vlrl command's arguments
  local name=$1; shift
  local start=$SECONDS
  timeout 120 python3 -m vlrl.cli "$@" model.device="$device" out=/tmp/gpu_cli_runs/"$name" >"$out/$name.log" 2>&1
  local rc=$?
  local last; last=$(grep -v '│' "$out/$name.log" | grep -E '^(rl|sft) step' | tail -1)
  [ $rc -ne 0 ] && last="$(grep -oE '[a-z_/]+\.py:[0-9]+ in [a-z_]+' "$out/$name.log" | tail -1): $(grep -E 'Error' "$out/$name.log" | tail -1)"
  echo "$name: rc=$rc in $((SECONDS - start)) s | $last"
}
run rl_sync rl --config configs/shapes_grpo.yaml "${small[@]}"
run rl_async rl --config configs/shapes_grpo.yaml "${small[@]}" rollout.mode=async staleness.eta=1
run rl_ppo rl --config configs/shapes_ppo.yaml "${small[@]}"
run rl_lora rl --config configs/shapes_lora_grpo.yaml "${small[@]}"
run rl_kl rl --config configs/shapes_grpo.yaml "${small[@]}" algo.kl_coef=0.01
run sft sft --config configs/shapes_sft.yaml train.steps=2 data.n_train=16 data.n_test=4 report.html=false

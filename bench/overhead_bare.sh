#!/usr/bin/env bash
# The benchmark config's stages by hand, with the bare tools: vLLM's server, the
# speculators CLI, curl. What a user would otherwise script; bench/overhead.py times it
# against the workflow on the same questions and the demo's settings.
#
#   bench/overhead_bare.sh MODEL QUESTIONS_DIR OUT_DIR
#
# QUESTIONS_DIR holds shard_0.jsonl and heldout.jsonl from the questions stage.
# Two departures from pure bare tools, both needed on a CPU machine and both also in
# the workflow: the CPU-safe hidden-states connector (draftsmith.hidden_states_connector)
# and the CPU shim around `speculators train` (draftsmith.speculators_cpu).
set -euo pipefail
model=$1 questions=$2 out=$3
port=8199 url=http://127.0.0.1:8199
mkdir -p "$out"
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1

serve() {  # serve [extra vLLM flags...]: start the target and wait until it answers
  python -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name "$model" \
    --host 127.0.0.1 --port $port --max-model-len 512 --enforce-eager --dtype bfloat16 "$@" \
    >>"$out/servers.log" 2>&1 &
  server=$!
  until curl -sf $url/health >/dev/null; do
    kill -0 $server || { tail -20 "$out/servers.log"; exit 1; }
    sleep 1
  done
}
stop() { kill $server; wait $server || true; }

# Generation: the target answers every training question.
serve
speculators regenerate-responses --endpoint $url/v1/chat/completions --model "$model" \
  --dataset "$questions/shard_0.jsonl" --concurrency 16 --max-tokens 64 \
  --sampling-params '{"temperature": 0.7, "top_p": 1.0, "seed": 0}' --outfile "$out/completions.jsonl"
stop

# Dataset: tokens, loss masks and token frequencies.
speculators prepare-data --model "$model" --data "$out/completions.jsonl" --output "$out/dataset" \
  --seq-length 448 --minimum-valid-tokens 1 --no-skip-token-freq \
  --token-freq-path "$out/dataset/token_freq.pt" --overwrite

# Extraction: hidden states of vLLM layers 2, 3, 5 and 6 (decoder outputs 1, 2, 4, 5).
serve --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 5, 6]}}}' \
  --kv-transfer-config "{\"kv_connector\": \"CpuSafeHiddenStatesConnector\",
    \"kv_connector_module_path\": \"draftsmith.hidden_states_connector\", \"kv_role\": \"kv_producer\",
    \"kv_connector_extra_config\": {\"shared_storage_path\": \"$out/kv\"}}"
speculators generate-offline-data --model "$model" --endpoint $url/v1 \
  --preprocessed-data "$out/dataset" --output "$out/hidden_states" --concurrency 8
stop

# Training: the same flags as the workflow's training stage.
python -m draftsmith.speculators_cpu train --verifier-name-or-path "$model" \
  --target-layer-ids 2 3 5 --token-freq-path "$out/dataset/token_freq.pt" --draft-vocab-size 200 \
  --num-layers 1 --epochs 15 --lr 0.003 --total-seq-len 2048 --seed 0 --save-path "$out/checkpoints" \
  --data-path "$out/dataset" --hidden-states-path "$out/hidden_states" --on-missing raise \
  --loss-implementation eager --num-workers 0 --draft-attn-impl sdpa --hidden-states-dtype float32

# Evaluation: held-out questions at temperature 0 with the drafter, then without it.
jq -c --arg model "$model" '{model: $model, messages: .messages, max_tokens: 64, temperature: 0}' \
  "$questions/heldout.jsonl" | split -l 1 - "$out/request_"
ask_all() {
  ls "$out"/request_* | xargs -P 8 -I{} curl -sf -o /dev/null -H 'Content-Type: application/json' \
    -d @{} $url/v1/chat/completions
}
serve --speculative-config "{\"model\": \"$out/checkpoints/checkpoint_best\", \"method\": \"eagle3\",
  \"num_speculative_tokens\": 3}"
ask_all
curl -sf $url/metrics | grep '^vllm:spec_decode' >"$out/spec_decode_metrics.txt"
stop
serve
ask_all
stop
awk '/^vllm:spec_decode_num_drafts_total/ {d += $2} /^vllm:spec_decode_num_accepted_tokens_total/ {a += $2}
  END {printf "{\"acceptance_length\": %.4f}\n", 1 + a / d}' "$out/spec_decode_metrics.txt" >"$out/acceptance.json"

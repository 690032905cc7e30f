"""What a vLLM CPU server burns while it waits, with and without draftsmith's idle plugin
(workflow/draftsmith/vllm_cpu_idle.py), and what it serves under load.

Two servers of the demo target, one with every draftsmith plugin and one without the idle
plugin (``VLLM_PLUGINS``). Each is measured twice:
- ``trickle``: one short request every 1.5 s, as a training job's capture server gets them;
  the CPU seconds its processes use per wall second;
- ``load``: 96 chat requests at concurrency 8, tokens per second (3 repetitions).

    python bench/cpu_idle_server.py --model results/demo_model
"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from results_file import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
from draftsmith.preflight import VLLM_PLUGINS  # noqa: E402
from draftsmith.server import free_port  # noqa: E402

WITHOUT_IDLE = ",".join(plugin.PLUGIN_NAME for plugin in VLLM_PLUGINS if plugin.PLUGIN_NAME != "draftsmith_cpu_idle")


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def server_cpu_seconds(server: subprocess.Popen) -> float:
    total = 0.0
    for process in psutil.Process(server.pid).children(recursive=True):
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def measure(model: str, plugins: str | None) -> dict:
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    command += ["--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    server = subprocess.Popen(command, env=env, start_new_session=True, **quiet)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        completion = {"model": model, "prompt": "count up from 3", "max_tokens": 8}
        post(port, "completions", completion)
        time.sleep(3)
        cpu_before, started = server_cpu_seconds(server), time.monotonic()
        for _ in range(20):
            post(port, "completions", completion)
            time.sleep(1.5)
        trickle = (server_cpu_seconds(server) - cpu_before) / (time.monotonic() - started)

        def ask(i: int) -> int:
            chat = {"messages": [{"role": "user", "content": f"count up from {i}"}], "max_tokens": 64}
            return post(port, "chat/completions", {"model": model, "temperature": 0, **chat})["usage"][
                "completion_tokens"
            ]

        load = []
        for _ in range(3):
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                tokens = sum(pool.map(ask, range(96)))
            load.append(round(tokens / (time.monotonic() - started), 1))
        return {"trickle_server_cpu_s_per_s": round(trickle, 3), "load_tokens_per_s": load}
    finally:
        os.killpg(server.pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="results/demo_model")
    args = parser.parse_args()
    runs = {"vllm_spin": measure(args.model, WITHOUT_IDLE), "idle_plugin": measure(args.model, None)}
    write_result(
        "cpu_idle_server",
        {
            "model": args.model,
            "cores": os.cpu_count(),
            "runs": runs,
            # Not measured by this script: recorded from two runs of the DeepSeek config's train
            # rule (benchmarks/train.tsv), before and after the plugin, the second after deleting
            # .staging/train: 550 rows stored, 90 captured in every epoch, 15 epochs.
            "deepseek_train_rule_recorded": {
                "train_s": {"vllm_spin": 388.3, "idle_plugin": 212.5},
                "validation_full_acc_0": {"vllm_spin": 0.821, "idle_plugin": 0.821},
                "acceptance_length": {"vllm_spin": 2.9207, "idle_plugin": 2.9207},
            },
        },
    )


if __name__ == "__main__":
    main()

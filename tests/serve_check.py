"""A finished run served by `python -m draftsmith.serve`, as a user would: an OpenAI client's
chat requests, the server's own spec-decode counters, and Ctrl-C leaving nothing behind."""

import json
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, heavy_processes_after
from openai import OpenAI

from draftsmith.evaluate import spec_decode_counters
from draftsmith.server import Endpoint, free_port, read_metrics, wait_until_healthy


def serve_and_measure(workdir: Path, results_dir: str, prompts: int = 8) -> float:
    """Start the serve command in `workdir`, send `prompts` counting chats, stop it with SIGINT
    (Ctrl-C); returns the acceptance length from the server's counters."""
    port = free_port()
    log = workdir / f"serve-{port}.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            # --drafter: the drafter whatever the recommendation (on a busy machine the target
            # alone may measure faster, and the serving config would then be null).
            [sys.executable, "-m", "draftsmith.serve", "--results-dir", results_dir, "--drafter", "--port", str(port)],
            cwd=workdir,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # No API key: the serve command sets none unless asked.
    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "", "")
    try:
        wait_until_healthy(process, endpoint, log, timeout_s=600)
        client = OpenAI(base_url=endpoint.base_url, api_key="unused")
        model = client.models.list().data[0].id
        lines = (ROOT / "config/demo_sets/counting.jsonl").read_text().splitlines()[:prompts]
        for line in lines:
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": json.loads(line)["prompt"]}],
                max_tokens=64,
                temperature=0,
            )
            assert reply.choices[0].message.content
        counters = spec_decode_counters(read_metrics(endpoint))
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    assert heavy_processes_after(30) == [], log.read_text()[-3000:]
    assert "Ctrl-C stops it" in log.read_text()
    assert counters["drafts"] > 0, counters
    return 1 + counters["accepted_tokens"] / counters["drafts"]

"""Where every benchmark writes its result: bench/results/<name>.json, also printed."""

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_result(name: str, result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    (RESULTS / f"{name}.json").write_text(text)
    print(text, end="")

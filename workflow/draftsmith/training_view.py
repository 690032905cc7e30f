"""Assemble the extraction shards into the one directory `speculators train` reads.

Hidden states are terabytes at production scale (~56 KiB per token for Kimi), so
they are never copied: the view holds relative symlinks ``hs_<row>.safetensors``
into the shard directories. Every row the extraction stored (rows ``0..N-1``: all of
them, or as many as ``hidden_states.disk_budget`` holds, as the shards' manifests say)
must be covered exactly once; training captures the others on demand. With no shards
(a budget of 0) the view is empty.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from draftsmith.atomic import publish_directory
from draftsmith.errors import DraftsmithError
from draftsmith.layout import HIDDEN_STATE_GLOB, hidden_state_row
from draftsmith.progress import log
from draftsmith.records import ShardManifest


class TrainingViewError(DraftsmithError):
    pass


def hidden_state_files(shard: Path) -> dict[int, Path]:
    return {hidden_state_row(path): path for path in shard.glob(HIDDEN_STATE_GLOB)}


def stored_row_count(shards: list[Path], rows: int) -> int:
    """Rows the shards must cover together: their manifests' ``stored_rows`` (all rows for a
    manifest from before disk budgets). Shards made under different budgets do not mix."""
    manifests = [ShardManifest.read(shard) for shard in shards]
    counts = {rows if m is None or m.stored_rows is None else m.stored_rows for m in manifests}
    if len(counts) > 1:
        raise TrainingViewError(
            f"the shards were extracted under different disk budgets ({sorted(counts)} rows); rerun extraction"
        )
    return counts.pop() if counts else 0


def build_view(shards: list[Path], rows: int, output: Path) -> None:
    stored = stored_row_count(shards, rows)
    files: dict[int, Path] = {}
    for shard in shards:
        for row, path in hidden_state_files(shard).items():
            if row in files:
                raise TrainingViewError(f"row {row} is in both {files[row].parent} and {shard}; rerun extraction")
            files[row] = path
    missing = sorted(set(range(stored)) - files.keys())
    if missing:
        raise TrainingViewError(
            f"{len(missing)} dataset rows have no hidden states (first: {missing[:5]}); rerun extraction"
        )
    beyond = sorted(files.keys() - set(range(stored)))
    if beyond:
        raise TrainingViewError(
            f"{len(beyond)} hidden-state files are past the {stored} stored rows "
            f"(first: row {beyond[0]}); rerun extraction"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    for _row, path in sorted(files.items()):
        (staged / path.name).symlink_to(os.path.relpath(path.resolve(), output.resolve().parent / output.name))
    publish_directory(staged, output)
    captured = f"; {rows - stored} rows are captured while training" if stored < rows else ""
    log(f"training view: {len(files)} links in {output}, 0 bytes of tensor data copied{captured}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, type=Path, help="prepared dataset (for the row count)")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("shards", nargs="*", type=Path, help="extraction shards (none with a disk budget of 0)")
    args = parser.parse_args(argv)
    from datasets import load_from_disk

    build_view(args.shards, len(load_from_disk(str(args.dataset))), args.output)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)

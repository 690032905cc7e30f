"""Run the real `speculators` CLI, adapted for a machine without an accelerator.

    python -m draftsmith.speculators_cpu train ARGS...   # == speculators train ARGS...

speculators 0.9.0 trains on CPU once three accelerator assumptions are lifted
(all in `speculators.train`, checked against 0.9.0):
- the Trainer moves the model and every batch to ``get_local_rank()`` (the int 0, i.e.
  the first accelerator) and autocasts on ``"cuda"`` when no accelerator exists;
- its step timer calls ``torch.accelerator.synchronize()``, which raises without one;
- its checkpointer loads a checkpoint onto ``get_current_device()``, which answers
  ``"cuda:0"`` without an accelerator, so resuming fails.
And one CPU cost: its default optimizer, ``torch.optim.Muon``, orthogonalizes each update
in bfloat16, which CPUs without bf16 matrix units (AVX2 only, like the CI machine) multiply
with a naive kernel: 3.1 s of a 4.7 s demo step. On CPU the same iteration runs in fp32.
Also on CPU only, the drafter's attention over packed documents and its eager KL loss skip
the work speculators spends on masked-out scores and per-entry logarithms (cpu_speedups;
1.7x the tokens/s at SmolLM2-135M's width, bench/train_cpu_width.py).
`apply()` changes nothing where an accelerator is present, so the same entry point
serves CUDA runs (under torchrun) unchanged.

Independently, ``DRAFTSMITH_METRICS_FILE=PATH`` appends every metric record speculators
logs (per step and per validation epoch) to PATH as JSON lines: speculators keeps them
only on the console unless tensorboard/wandb/trackio/mlflow is installed.

On every device, each epoch's checkpoint keeps the weights and optimizer state exactly
(``lossless_checkpoints``): speculators rounds both to bf16 when it saves, so a run resumed
from a checkpoint trained on from rounded fp32 weights, rounded Adam moments and a rounded
step count (bf16 holds integers exactly only up to 256), and its losses left the
uninterrupted run's from the first epoch after the restart. The published drafter is still
bf16 (drafter_publish.py converts it, as speculators would have).

And for rows captured while training (``--on-missing generate``, see train.py), on every
device: the wait for a captured file's lock polls every 10 ms instead of 100 ms (the
file is written just after the response; the extraction stage measured the default
halving its rate), and the HTTP client's line per request stays out of the log.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

METRICS_FILE_ENV = "DRAFTSMITH_METRICS_FILE"
# Third-party names this module uses or replaces; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("speculators.cli", "app"),
    ("speculators.train.cli", "Trainer"),
    ("speculators.train.cli", "setup_metric_logger"),
    ("speculators.train.checkpointer", "get_current_device"),
    ("speculators.train.trainer", "Trainer.setup_model"),
    ("torch.optim._muon", "_zeropower_via_newtonschulz"),
    ("hs_connectors.transfer", "wait_for_lock"),
    ("speculators.train.checkpointer", "SingleGPUCheckpointer"),
    ("speculators.train.checkpointer", "DistributedCheckpointer"),
]
# fp32 holds every fp32 and bf16 value exactly: a checkpoint in it resumes bit for bit.
CHECKPOINT_DTYPE = torch.float32
CAPTURE_LOCK_POLL_S = 0.01


def apply() -> bool:
    """Adapt speculators' trainer to CPU when no accelerator is present; True if it did."""
    if torch.accelerator.is_available():
        return False
    from speculators.train import checkpointer, cli, trainer
    from torch.optim import _muon as muon

    class CpuTrainer(trainer.Trainer):
        def setup_model(self) -> None:
            # setup_model is the first step that uses the device; __init__ set both fields
            # from the (absent) accelerator just before.
            self.local_rank = "cpu"  # type: ignore[assignment]  # speculators moves tensors .to(local_rank)
            self.device_type = "cpu"
            # A drafter loaded with --from-pretrained keeps its stored dtype (bf16 when
            # published), and on CPU the trainer computes in fp32 without autocast: its
            # matmuls would mix the two. Floating weights only: the vocabulary map stays int.
            self.model.to(torch.float32)
            super().setup_model()

    cli.Trainer = CpuTrainer  # type: ignore[misc]  # the CLI builds whatever cli.Trainer names
    checkpointer.get_current_device = lambda: "cpu"
    muon._zeropower_via_newtonschulz = newton_schulz_fp32
    # CPU work is synchronous: there is nothing to wait for.
    torch.accelerator.synchronize = lambda device=None: None
    faster_attention_and_loss()
    return True


def faster_attention_and_loss() -> None:
    """The drafter's attention over packed documents and its eager KL loss, without the
    work speculators spends on masked-out scores and per-entry logarithms (cpu_speedups)."""
    from draftsmith import cpu_speedups

    cpu_speedups.install()


def newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch's Muon orthogonalization (the same quintic Newton-Schulz iteration, see
    ``torch.optim._muon``) computed in fp32 instead of bfloat16. Our own because torch's
    hard-codes the bf16 cast; it is a few lines and its result is the more precise one."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    ortho = (grad.T if tall else grad).float()
    ortho = ortho / ortho.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho.T if tall else ortho


class JsonLinesHandler(logging.Handler):
    """Appends mapping records (speculators' metric format) as JSON lines, on rank 0 only."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, Mapping) or getattr(record, "hparams", False):
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record.msg, default=float) + "\n")


# A line per captured row otherwise; the openai client speculators asks with logs through
# httpx2 (httpx's successor), other clients through httpx.
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2")


def after_logging_setup(metrics_file: Path | None) -> None:
    """Once speculators has configured its loggers (its dictConfig drops handlers attached
    earlier): attach the JSON-lines metrics sink, and keep httpx's per-request lines out."""
    from speculators.train import cli

    configure = cli.setup_metric_logger

    def setup_then_adjust(*args, **kwargs) -> None:
        configure(*args, **kwargs)
        for client in HTTP_CLIENT_LOGGERS:
            logging.getLogger(client).setLevel(logging.WARNING)
        if metrics_file is not None and int(os.environ.get("RANK", "0")) == 0:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            logging.getLogger("speculators.metrics").addHandler(JsonLinesHandler(metrics_file))

    cli.setup_metric_logger = setup_then_adjust


def lossless_checkpoints() -> None:
    """Save checkpoints in fp32 instead of speculators' default bf16 (its ``float_dtype``
    argument, which no flag of its CLI sets), so a resumed run continues exactly."""
    from speculators.train import checkpointer

    for saver in (checkpointer.SingleGPUCheckpointer, checkpointer.DistributedCheckpointer):
        save = saver.save_checkpoint

        def save_exactly(self, model, optimizer, epoch, float_dtype=None, _save=save) -> None:
            _save(self, model, optimizer, epoch, float_dtype=CHECKPOINT_DTYPE)

        saver.save_checkpoint = save_exactly  # type: ignore[method-assign]


def quicker_capture_wait() -> None:
    """A captured file is read once its writer releases the lock; poll it every 10 ms."""
    from hs_connectors import transfer

    wait = transfer.wait_for_lock
    transfer.wait_for_lock = lambda lock_path, timeout=10.0, poll_interval=CAPTURE_LOCK_POLL_S: wait(
        lock_path, timeout=timeout, poll_interval=poll_interval
    )


def main() -> None:
    from speculators.cli import app

    apply()
    metrics_file = os.environ.get(METRICS_FILE_ENV)
    after_logging_setup(Path(metrics_file) if metrics_file else None)
    quicker_capture_wait()
    lossless_checkpoints()
    app()  # reads sys.argv like the `speculators` console script


if __name__ == "__main__":
    main()

"""The training stage: real `speculators train` on CPU over a tiny target and synthetic states."""

import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import heavy_processes_after, server_settings, write_shard_manifest
from datasets import Dataset, load_from_disk
from safetensors.torch import save_file
from snakemake.utils import validate
from transformers import AutoConfig

from draftsmith import speculators_cpu, train
from draftsmith.config_check import cross_field_problems
from draftsmith.demo_model import build_demo_model
from draftsmith.disk_budget import StoredRowFormat, dataset_row_tokens
from draftsmith.layers import resolve_layers
from draftsmith.layout import TrainPaths
from draftsmith.records import RowIds, TrainingMetrics
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint
from draftsmith.settings import reruns_between, tracked_settings
from draftsmith.slot import GpuSlotError
from draftsmith.train import (
    TrainError,
    run,
    speculators_args,
    train_command,
    training_processes,
)
from draftsmith.training_checkpoints import drop_unfinished_epoch, reset_if_changed

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 2, 4, 5]  # the demo's: aux vLLM ids 2, 3, 5; layer 5 (of 6) is the target
AUX_VLLM_IDS = [2, 3, 5]
HIDDEN = 128
ROWS = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train_target") / "model"
    build_demo_model(path, train_seconds=2, eval_per_task=0)
    return path


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory) -> Path:
    """A prepare-data output over pre-tokenized rows, with row_ids.json as the dataset stage writes."""
    root = tmp_path_factory.mktemp("train_data")
    rng = random.Random(0)
    rows = []
    for _ in range(ROWS):
        length = rng.randint(20, 40)
        rows.append(
            {
                "input_ids": [1] + [rng.randint(9, 200) for _ in range(length)],
                "loss_mask": [0] * 10 + [1] * (length - 9),
            }
        )
    source = root / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = root / "dataset"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "speculators",
            "prepare-data",
            "--model",
            str(target),
            "--data",
            str(source),
            "--output",
            str(output),
            "--seq-length",
            "64",
            "--no-skip-token-freq",
            "--token-freq-path",
            str(output / "token_freq.pt"),
            "--num-preprocessing-workers",
            "1",
        ],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    RowIds([f"q-{i}" for i in range(ROWS)]).write(output)
    return output


@pytest.fixture(scope="module")
def hidden_states(dataset, tmp_path_factory) -> Path:
    """Random bf16 states of the right shape for every row; the token ids match the row."""
    directory = tmp_path_factory.mktemp("hidden_states")
    for row, input_ids in enumerate(load_from_disk(str(dataset)).with_format(None)["input_ids"]):
        save_file(
            {
                "hidden_states": torch.randn(len(input_ids), len(LAYERS), HIDDEN).to(torch.bfloat16),
                "token_ids": torch.tensor(input_ids),
            },
            directory / f"hs_{row}.safetensors",
        )
    return directory


def settings(target: Path, **training) -> dict:
    return {
        "target": {"model": str(target), "trust_remote_code": False},
        "layers": LAYERS,
        "device": "cpu",
        "gpu_slot": 1,
        "server": {"tensor_parallel_size": 1, "data_parallel_size": 1, "extra_args": []},
        "hidden_states": {"disk_budget": "all", "stored_dtype": "served", "capture_memory_fraction": 0.5},
        "training": {
            "epochs": 2,
            "lr": 1e-3,
            "draft_vocab_size": 100,
            "total_seq_len": 128,
            "num_layers": 1,
            "seed": 0,
            "stall_timeout_s": 600,
            "extra_args": [],
            "validation_fraction": 0.1,
            **training,
        },
    }


def stage_paths(root: Path, dataset: Path, hidden_states: Path) -> TrainPaths:
    return TrainPaths(dataset, hidden_states, root / "staging", root / "drafter")


@pytest.mark.training
def test_trains_on_cpu_and_publishes_drafter(target, dataset, hidden_states, tmp_path):
    paths = stage_paths(tmp_path, dataset, hidden_states)
    run(RunConfig.from_dict(settings(target)), paths)

    assert sorted(p.name for p in paths.output.iterdir()) == [
        "config.json",
        "model.safetensors",
        "training_metrics.json",
    ]
    config = json.loads((paths.output / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_VLLM_IDS
    assert config["draft_vocab_size"] == 100
    metrics = TrainingMetrics.read(paths.output)
    assert [e["epoch"] for e in metrics.epochs] == [0, 1]
    assert metrics.published_epoch in (0, 1)
    assert (metrics.rows_stored, metrics.rows_captured_per_epoch, metrics.capture_requests) == (ROWS, 0, 0)
    # speculators' vocabulary mappings land in training's own view, not in the dataset.
    assert not list(dataset.glob("*.npy")) and sorted(p.name for p in paths.dataset_view.glob("*.npy")) == [
        "d2t-100.npy",
        "t2d-100.npy",
    ]
    for epoch in metrics.epochs:
        assert epoch["steps"] > 0
        assert {"loss", "full_acc_0"} <= set(epoch["train"]) and {"loss", "full_acc_0"} <= set(epoch["val"])


def test_draft_vocab_larger_than_target_fails_fast(target, dataset, hidden_states, tmp_path):
    paths = stage_paths(tmp_path, dataset, hidden_states)
    vocab = AutoConfig.from_pretrained(target).vocab_size
    with pytest.raises(TrainError, match=rf"draft_vocab_size {vocab + 1} exceeds the target's vocabulary of {vocab};"):
        run(RunConfig.from_dict(settings(target, draft_vocab_size=vocab + 1)), paths)
    assert not paths.staging.exists()


def test_missing_hidden_states_fail_fast_naming_the_row(target, dataset, hidden_states, tmp_path):
    partial = tmp_path / "hidden_states"
    partial.mkdir()
    for row in range(ROWS):
        if row != 3:
            (partial / f"hs_{row}.safetensors").symlink_to(hidden_states / f"hs_{row}.safetensors")
    paths = stage_paths(tmp_path, dataset, partial)
    with pytest.raises(TrainError, match=r"1 of 8 stored dataset rows .*: row 3 \(question q-3\); rerun"):
        run(RunConfig.from_dict(settings(target)), paths)
    assert not paths.staging.exists()


def budget_for(target: Path, dataset: Path, rows: int) -> int:
    """The disk budget that stores exactly the first ``rows`` rows of ``dataset``."""
    row = StoredRowFormat(len(LAYERS), AutoConfig.from_pretrained(target).hidden_size, "bfloat16")
    return sum(row.row_bytes(n) for n in dataset_row_tokens(dataset)[:rows])


def test_under_a_disk_budget_only_the_stored_rows_need_files(target, dataset, hidden_states, tmp_path):
    stored = tmp_path / "hidden_states"
    stored.mkdir()
    for row in range(3):
        (stored / f"hs_{row}.safetensors").symlink_to(hidden_states / f"hs_{row}.safetensors")
    budget = {"disk_budget": budget_for(target, dataset, 3), "stored_dtype": "served", "capture_memory_fraction": 0.5}
    budgeted = settings(target) | {"hidden_states": budget}
    split = train.preflight(RunConfig.from_dict(budgeted), stage_paths(tmp_path, dataset, stored)).split
    assert (split.rows, split.stored, split.mode) == (ROWS, 3, "budget")
    # All rows on disk while the budget holds three: the extraction is stale, training stops.
    with pytest.raises(TrainError, match=r"more rows than hidden_states.disk_budget stores \(3\); rerun"):
        train.preflight(RunConfig.from_dict(budgeted), stage_paths(tmp_path, dataset, hidden_states))


@pytest.mark.training
def test_rerun_with_more_epochs_resumes_from_checkpoint(target, dataset, hidden_states, tmp_path, capfd):
    paths = stage_paths(tmp_path, dataset, hidden_states)
    run(RunConfig.from_dict(settings(target, epochs=1)), paths)
    first_log = capfd.readouterr().out
    assert "Starting fresh training run" in first_log
    epoch0 = paths.checkpoints / "0" / "model.safetensors"
    epoch0_written = epoch0.stat().st_mtime_ns

    run(RunConfig.from_dict(settings(target, epochs=2)), paths)
    second_log = capfd.readouterr().out
    assert "Resuming training on epoch 1" in second_log
    assert "Training epoch 1/2 started" not in second_log  # epoch 0 is not trained again
    assert "Training epoch 2/2 started" in second_log
    assert epoch0.stat().st_mtime_ns == epoch0_written
    assert [e["epoch"] for e in TrainingMetrics.read(paths.output).epochs] == [0, 1]


# The training stage in a process of its own, as Snakemake starts it (run_main is left out:
# it would tie the stage to this test process as to its launcher).
STAGE = (
    "import json, sys; from pathlib import Path; from draftsmith import train; "
    "from draftsmith.layout import TrainPaths; from draftsmith.run_config import RunConfig; "
    "train.run(RunConfig.from_dict(json.loads(sys.argv[1])), TrainPaths(*map(Path, sys.argv[2:])))"
)


def start_stage(config: dict, paths: TrainPaths, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-c", STAGE, json.dumps(config)]
    argv += map(str, (paths.dataset, paths.hidden_states, paths.staging, paths.output))
    with log.open("w") as output:
        return subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def kill_after_checkpoint(stage: subprocess.Popen, paths: TrainPaths, epoch: int, log: Path) -> None:
    """SIGKILL the stage's process group as soon as ``epoch``'s checkpoint is complete:
    while that epoch is validated, or just after."""
    deadline = time.monotonic() + 600
    while not (paths.checkpoints / str(epoch) / "training_state.json").is_file():
        assert stage.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"epoch {epoch} never finished"
        time.sleep(0.02)
    os.killpg(stage.pid, signal.SIGKILL)
    stage.wait(timeout=60)


@pytest.mark.training
@pytest.mark.vllm
def test_killed_under_a_disk_budget_and_resumed_trains_exactly_as_uninterrupted(
    target, dataset, hidden_states, tmp_path, capfd
):
    """3 rows stored, 5 captured from the capture server in every epoch. A SIGKILL once epoch
    1's checkpoint is written, then the same stage: every epoch's losses and the published
    drafter equal an uninterrupted run's, bit for bit. Two causes broke this: speculators'
    checkpoints in bf16 (the resume started from rounded weights), and its validation after
    the checkpoint (a kill in between lost the epoch's validation and best-epoch choice)."""
    stored = tmp_path / "hidden_states"
    stored.mkdir()
    for row in range(3):
        (stored / f"hs_{row}.safetensors").symlink_to(hidden_states / f"hs_{row}.safetensors")
    budget = {"disk_budget": budget_for(target, dataset, 3), "stored_dtype": "served", "capture_memory_fraction": 0.5}
    config = settings(target, epochs=3) | {"server": server_settings(target)["server"], "hidden_states": budget}
    whole, resumed = (stage_paths(tmp_path / name, dataset, stored) for name in ("whole", "resumed"))

    # The uninterrupted run and the one to kill side by side: most of a stage's start is
    # single-threaded imports, so two overlap on two cores (145 s against 155 s one after the other).
    logs = {name: tmp_path / f"{name}.log" for name in ("whole", "killed")}
    uninterrupted = start_stage(config, whole, logs["whole"])
    kill_after_checkpoint(start_stage(config, resumed, logs["killed"]), resumed, 1, logs["killed"])
    assert uninterrupted.wait(timeout=600) == 0, logs["whole"].read_text()[-3000:]
    assert heavy_processes_after(20) == []  # the guards stopped the killed trainer and its capture server
    finished = sorted(p.parent.name for p in resumed.checkpoints.glob("[0-9]*/training_state.json"))
    assert "2" not in finished, f"the kill came after the last epoch: {finished}"
    run(RunConfig.from_dict(config), resumed)
    assert "Resuming training on epoch" in capfd.readouterr().out

    metrics = [TrainingMetrics.read(paths.output) for paths in (whole, resumed)]
    assert metrics[0].rows_captured_per_epoch == 5 and metrics[1].capture_requests > 0
    assert [e["epoch"] for e in metrics[0].epochs] == [0, 1, 2]
    assert metrics[1].epochs == metrics[0].epochs  # every loss and accuracy, to the last bit
    weights = [(paths.output / "model.safetensors").read_bytes() for paths in (whole, resumed)]
    assert weights[0] == weights[1]


def test_changed_arguments_or_unfinished_epoch_drop_checkpoints(target, dataset, hidden_states, tmp_path):
    paths = stage_paths(tmp_path, dataset, hidden_states)
    plan = resolve_layers(LAYERS, 6)
    for epoch in ("0", "1"):
        (paths.checkpoints / epoch).mkdir(parents=True)
    (paths.checkpoints / "0" / "training_state.json").write_text("{}")
    drop_unfinished_epoch(paths)  # epoch 1 lacks the state file written last
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["0"]
    (paths.checkpoints / "1").mkdir()
    (paths.checkpoints / "1" / "training_state.json").write_text("{}")
    paths.metrics.write_text(json.dumps({"epoch": 0, "val": {"loss_epoch": 1.0}}) + "\n")
    drop_unfinished_epoch(paths)  # epoch 1 is whole, but its validation never finished
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["0"]
    drop_unfinished_epoch(paths)  # epoch 0 was validated: it stays
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["0"]

    software = {"speculators": "0.9.0"}
    reset_if_changed(paths, speculators_args(RunConfig.from_dict(settings(target)), plan, paths), 2, software)
    reset_if_changed(paths, speculators_args(RunConfig.from_dict(settings(target, epochs=5)), plan, paths), 5, software)
    assert (paths.checkpoints / "0").is_dir()  # more epochs continue
    reset_if_changed(
        paths,
        speculators_args(RunConfig.from_dict(settings(target, epochs=5)), plan, paths),
        5,
        {"speculators": "0.10.0"},
    )
    assert not paths.checkpoints.exists()  # an upgraded trainer starts afresh
    (paths.checkpoints / "0").mkdir(parents=True)
    reset_if_changed(paths, speculators_args(RunConfig.from_dict(settings(target, lr=0.1)), plan, paths), 5, software)
    assert not paths.checkpoints.exists()
    # Past a disk budget the capture server's port is new at every start; the checkpoints stay.
    captured = speculators_args(RunConfig.from_dict(settings(target)), plan, paths, captures=True)
    reset_if_changed(paths, captured, 5, software)
    (paths.checkpoints / "0").mkdir(parents=True)
    reset_if_changed(
        paths, speculators_args(RunConfig.from_dict(settings(target)), plan, paths, captures=True), 5, software
    )
    assert (paths.checkpoints / "0").is_dir()
    # fp8 rows are read through speculators' fp8 backend; a change of storage starts afresh.
    fp8 = settings(target) | {"hidden_states": settings(target)["hidden_states"] | {"stored_dtype": "fp8"}}
    fp8_args = speculators_args(RunConfig.from_dict(fp8), plan, paths, captures=True)
    assert fp8_args[fp8_args.index("--hidden-states-backend") + 1] == "fp8"
    assert "--hidden-states-backend" not in captured
    reset_if_changed(paths, fp8_args, 5, software)
    assert not paths.checkpoints.exists()


def test_cuda_runs_one_torchrun_process_per_gpu_of_the_slot(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    kimi = {
        **settings(Path("/models/kimi")),
        "device": "cuda",
        "gpu_slot": 8,
        "layers": [2, 30, 58, 60],
        "server": {"tensor_parallel_size": 8, "data_parallel_size": 1},
    }
    plan = resolve_layers(kimi["layers"], 61)
    paths = stage_paths(tmp_path, tmp_path / "dataset", tmp_path / "hs")

    command = train_command(
        RunConfig.from_dict(kimi), plan, paths, training_processes(RunConfig.from_dict(kimi), granted=8), captures=False
    )

    assert command[:10] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "8",
        "-m",
        "draftsmith.speculators_cpu",
        "train",
        "--verifier-name-or-path",
    ]
    flags = " ".join(command)
    assert " --target-layer-ids 3 31 59 --" in flags
    for expected in (
        "--on-missing raise",
        "--loss-implementation eager",
        f"--save-path {paths.checkpoints}",
        f"--hidden-states-path {tmp_path / 'hs'}",
    ):
        assert expected in flags
    # The CPU-only flags stay off a GPU run (GPU configs need no extra_args to undo them).
    assert "--num-workers" not in flags and "--hidden-states-dtype" not in flags
    cpu = train_command(
        RunConfig.from_dict(settings(Path("/models/demo"))), resolve_layers(LAYERS, 6), paths, 1, captures=False
    )
    assert " ".join(train.CPU_TRAINER_FLAGS) in " ".join(cpu)
    # Past a disk budget, rows come from the capture server, named by a placeholder until
    # it runs, so the recorded arguments (and the checkpoints) survive its new port.
    online = train_command(RunConfig.from_dict(kimi), plan, paths, 8, captures=True)
    assert f"--on-missing generate --vllm-endpoint {train.CAPTURE_ENDPOINT}" in " ".join(online)
    endpoint = Endpoint("http://127.0.0.1:4242/v1", "EMPTY", "/models/kimi")
    assert "http://127.0.0.1:4242/v1" in train.with_endpoint(online, endpoint)
    with pytest.raises(GpuSlotError, match="granted 4"):
        training_processes(RunConfig.from_dict(kimi), granted=4)


def test_another_kind_changes_only_the_type_and_eagle3_keeps_its_recorded_command(tmp_path):
    """EAGLE-3's arguments stay those of runs made before kinds existed (a changed command
    would reset their checkpoints); another kind adds its type, then every kind's
    extra_args, then its own kind_args; DFlash2 trains only over the target's whole vocabulary."""
    kind_args = {"peagle": ["--num-depths", "3"]}
    run = RunConfig.from_dict(settings(Path("/models/demo"), extra_args=["--x", "1"], kind_args=kind_args))
    plan, paths = resolve_layers(LAYERS, 6), stage_paths(tmp_path, tmp_path / "dataset", tmp_path / "hs")
    eagle3 = speculators_args(run, plan, paths)
    assert "--speculator-type" not in eagle3 and eagle3 == speculators_args(run, plan, paths, kind="eagle3")
    peagle = speculators_args(run, plan, paths, kind="peagle", target_vocab_size=226)
    assert peagle == [*eagle3[:-2], "--speculator-type", "peagle", "--x", "1", "--num-depths", "3"]
    dflash2 = speculators_args(run, plan, paths, kind="dflash2", target_vocab_size=226)
    assert dflash2[-6:] == ["--speculator-type", "dflash2", "--draft-vocab-size", "226", "--x", "1"]


def test_the_validation_fraction_sizes_the_trainers_split_and_changes_nothing_at_its_default(dataset, tmp_path):
    """training.validation_fraction is speculators' --train-data-ratio turned around. At its
    default (speculators' own) the command and the params are those of runs made before the
    key existed, so they neither re-run nor restart their checkpoints."""
    plan, paths = resolve_layers(LAYERS, 6), stage_paths(tmp_path, tmp_path / "dataset", tmp_path / "hs")
    demo = Path("/models/demo")
    default = speculators_args(RunConfig.from_dict(settings(demo)), plan, paths)
    assert "--train-data-ratio" not in default
    quarter = speculators_args(RunConfig.from_dict(settings(demo, validation_fraction=0.25)), plan, paths)
    assert quarter == [*default, "--train-data-ratio", "0.75"]
    # The split the prediction's noise band is counted on follows it.
    assert train.validation_positions(dataset, 0.25) > train.validation_positions(dataset, 0.1) > 0

    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    assert "training.validation_fraction" not in tracked_settings(config, "train")
    changed = copy.deepcopy(config)
    changed["training"]["validation_fraction"] = 0.25
    assert tracked_settings(changed, "train")["training.validation_fraction"] == 0.25
    assert reruns_between(config, changed) >= {"train", "evaluate_drafter", "evaluate"}
    assert "untrained_drafter" not in reruns_between(config, changed)  # never validated
    # One place to set it.
    changed["training"]["extra_args"] = ["--train-data-ratio", "0.5"]
    (problem,) = cross_field_problems(RunConfig.from_dict(changed))
    assert problem.startswith("config training.extra_args sets --train-data-ratio") and "validation_fraction" in problem


def test_cpu_adaptations_leave_an_accelerator_machine_alone(monkeypatch):
    from speculators.train import cli
    from torch.optim import _muon

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    trainer_class, orthogonalize = cli.Trainer, _muon._zeropower_via_newtonschulz
    assert speculators_cpu.apply() is False
    assert cli.Trainer is trainer_class and _muon._zeropower_via_newtonschulz is orthogonalize


def test_on_cpu_the_trainer_orthogonalizes_in_fp32(monkeypatch):
    from speculators.train import checkpointer, cli
    from torch.optim import _muon

    for owner, name in ((cli, "Trainer"), (checkpointer, "get_current_device"), (_muon, "_zeropower_via_newtonschulz")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    monkeypatch.setattr(torch.accelerator, "synchronize", torch.accelerator.synchronize)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    installed = []  # cpu_speedups' patches are tested in test_cpu_speedups.py; not left installed here
    monkeypatch.setattr(speculators_cpu, "faster_attention_and_loss", lambda: installed.append(True))
    assert speculators_cpu.apply() is True
    assert _muon._zeropower_via_newtonschulz is speculators_cpu.newton_schulz_fp32
    assert installed == [True]


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)])
def test_cpu_muon_orthogonalizes_like_torch_in_fp32(shape):
    """The fp32 Newton-Schulz the CPU trainer uses is torch's iteration: it agrees with
    torch's bf16 result to bf16 precision, on tall and wide matrices."""
    from torch.optim import _muon

    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    args = ((_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C), _muon.DEFAULT_NS_STEPS, 1e-7)
    ours = speculators_cpu.newton_schulz_fp32(grad, *args)
    torch_bf16 = _muon._zeropower_via_newtonschulz(grad, *args)
    assert ours.dtype == torch.float32 and ours.shape == grad.shape
    torch.testing.assert_close(ours, torch_bf16.float(), atol=0.02, rtol=0.05)
    assert not torch.equal(ours, torch_bf16.float())  # it did not just call torch's bf16 one


def published_copy(dataset: Path, hidden_states: Path, root: Path, items: str) -> TrainPaths:
    """The inputs as the workflow republishes them: new files (new times), a shard with its
    manifest, and a training view of links into it."""
    shutil.copytree(dataset, root / "dataset")
    shard = root / "shard_0"
    shutil.copytree(hidden_states, shard)
    write_shard_manifest(shard, items_fingerprint=items)
    (root / "view").mkdir()
    for path in shard.glob("hs_*.safetensors"):
        (root / "view" / path.name).symlink_to(path)
    return TrainPaths(root / "dataset", root / "view", root / "staging", root / "out")


def test_checkpoints_survive_a_republish_but_not_new_data(dataset, hidden_states, tmp_path):
    """Resume on the same inputs by content: a republished copy (new files, new times) and
    speculators' own caches in the dataset directory resume; hidden states made under
    other settings, other token counts (another draft vocabulary) or other tokens do not."""
    from draftsmith.training_checkpoints import inputs_fingerprint

    before = inputs_fingerprint(published_copy(dataset, hidden_states, tmp_path / "a", "same"))
    again = published_copy(dataset, hidden_states, tmp_path / "b", "same")
    (again.dataset / "d2t-200.npy").write_bytes(b"cache")
    (again.dataset / ".snakemake_timestamp").touch()
    assert inputs_fingerprint(again) == before
    other = published_copy(dataset, hidden_states, tmp_path / "c", "other layers")
    assert inputs_fingerprint(other) != before
    recounted = published_copy(dataset, hidden_states, tmp_path / "g", "same")  # another draft vocabulary
    torch.save({1: 1}, recounted.dataset / "token_freq.pt")
    assert inputs_fingerprint(recounted) != before
    rows = load_from_disk(str(dataset)).with_format(None).to_list()
    fingerprints = []
    for name, shift in (("e", 0), ("f", 1)):  # the same rows rewritten, then one token changed
        rewritten = published_copy(dataset, hidden_states, tmp_path / name, "same")
        rows[0]["input_ids"][1] += shift
        shutil.rmtree(rewritten.dataset)
        Dataset.from_list(rows).save_to_disk(str(rewritten.dataset))
        shutil.copy(dataset / "row_ids.json", rewritten.dataset / "row_ids.json")
        fingerprints.append(inputs_fingerprint(rewritten))
    assert fingerprints[0] != fingerprints[1]


def run_stage_with_trainer(trainer_code: str, tmp_path: Path, stall_timeout_s: float) -> str:
    """run_trainer on a stand-in trainer, with the stage's stderr in a log file as under Snakemake."""
    trainer = [sys.executable, "-c", trainer_code]
    stage = [
        sys.executable,
        "-c",
        f"from pathlib import Path; from draftsmith.trainer_process import run_trainer; "
        f"run_trainer({trainer!r}, Path({str(tmp_path / 'metrics.jsonl')!r}), {stall_timeout_s})",
    ]
    log = tmp_path / "train.log"
    with log.open("w") as stderr:
        assert subprocess.run(stage, stderr=stderr, timeout=120).returncode != 0
    return log.read_text()


OOM_LINE = "print('torch.OutOfMemoryError: CUDA out of memory', file=sys.stderr, flush=True)"


@pytest.mark.slow  # waits out a stall timeout
def test_a_trainer_that_hangs_after_crashing_is_stopped_and_named(tmp_path):
    """A worker that prints its traceback and then hangs, holding the GPU. A real trainer
    cannot be made to hang on demand, so a stand-in prints and sleeps."""
    started = time.monotonic()
    log = run_stage_with_trainer(f"import sys, time; {OOM_LINE}; time.sleep(600)", tmp_path, stall_timeout_s=3)
    assert "TrainError: speculators train wrote nothing for 3s, so it was stopped" in log
    assert time.monotonic() - started < 30
    assert heavy_processes_after(20) == []  # the guard and the hung worker are gone


def test_a_trainer_out_of_gpu_memory_is_named_with_the_fix(tmp_path):
    log = run_stage_with_trainer(f"import sys; {OOM_LINE}; sys.exit(1)", tmp_path, stall_timeout_s=600)
    assert log.rstrip().splitlines()[-1] == (
        "draftsmith.errors.TrainError: speculators train ran out of GPU memory (exit 1); lower "
        "training.total_seq_len (tokens per step) and rerun"
    )


def test_a_disk_that_fills_while_training_is_named_with_the_fix(tmp_path):
    """The capture server's write failing on a full disk (a real one cannot be filled on
    demand here): the trainer exits after its retries, and the stage says why in one line."""
    full = "print('OSError: [Errno 28] No space left on device', file=sys.stderr, flush=True)"
    log = run_stage_with_trainer(f"import sys; {full}; sys.exit(1)", tmp_path, stall_timeout_s=600)
    assert log.rstrip().splitlines()[-1] == (
        "draftsmith.errors.TrainError: the disk filled while training (exit 1: captured rows or a checkpoint could "
        "not be written); free space or lower hidden_states.disk_budget, then rerun: training resumes"
    )


def test_the_trainer_gets_no_thread_caps_from_snakemake(tmp_path, monkeypatch):
    """Snakemake exports OMP_NUM_THREADS=1 to every job; the CPU trainer ran on one core
    with it (133 s vs 74 s by hand, bench/overhead.py)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    log = run_stage_with_trainer(
        "import os, sys; print('trainer sees OMP_NUM_THREADS=' + str(os.environ.get('OMP_NUM_THREADS')), "
        "file=sys.stderr, flush=True); sys.exit(1)",
        tmp_path,
        stall_timeout_s=600,
    )
    assert "trainer sees OMP_NUM_THREADS=None" in log


def test_the_trainer_logs_wide_lines_whatever_columns_the_caller_exports(tmp_path, monkeypatch):
    """Rich wraps at COLUMNS; a shell that exports 80 wrapped the trainer's lines mid-message
    (a fresh run's "Starting fresh training run" no longer greppable)."""
    monkeypatch.setenv("COLUMNS", "80")
    log = run_stage_with_trainer(
        "import os, sys; print('trainer sees COLUMNS=' + os.environ['COLUMNS'], file=sys.stderr, flush=True); "
        "sys.exit(1)",
        tmp_path,
        stall_timeout_s=600,
    )
    assert "trainer sees COLUMNS=200" in log


def test_the_trainer_waits_for_a_captured_file_in_10_ms_steps(monkeypatch):
    from hs_connectors import transfer

    calls = []
    monkeypatch.setattr(
        transfer,
        "wait_for_lock",
        lambda lock, timeout=10.0, poll_interval=0.1: calls.append((lock, timeout, poll_interval)),
    )
    speculators_cpu.quicker_capture_wait()
    transfer.wait_for_lock("hs_7.safetensors.lock")  # as hs_connectors calls it
    assert calls == [("hs_7.safetensors.lock", 10.0, speculators_cpu.CAPTURE_LOCK_POLL_S)]


def test_the_trainer_logs_no_line_per_captured_row(monkeypatch, tmp_path):
    """speculators asks the capture server through the openai client: whatever HTTP client
    that uses, its per-request INFO lines stay out of the train log."""
    import logging

    from openai import _base_client
    from speculators.train import cli

    monkeypatch.setattr(cli, "setup_metric_logger", lambda *args, **kwargs: None)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)  # as speculators' root logger is
    try:
        speculators_cpu.after_logging_setup(None)
        cli.setup_metric_logger(loggers="", run_name="test", output_dir=str(tmp_path))
        # The HTTP client class openai wraps, and the package it comes from (httpx or httpx2).
        client = next(cls for cls in _base_client.SyncHttpxClientWrapper.__mro__ if cls.__name__ == "Client")
        assert not logging.getLogger(client.__module__.split(".")[0]).isEnabledFor(logging.INFO)
    finally:
        root.setLevel(level)


def test_a_published_drafter_is_of_its_kind_and_names_the_layers_trained_on(tmp_path):
    """DFlash keeps its layer ids under another key than EAGLE-3; the ids vLLM captures at
    serving time are those the rows were extracted from. A checkpoint of another kind than
    the job's (extra_args can change the type) stops the job instead of being served wrongly."""
    from draftsmith.drafter_publish import stage_drafter
    from draftsmith.errors import TrainError

    epoch = tmp_path / "checkpoints" / "4"
    epoch.mkdir(parents=True)
    save_file({"fc.weight": torch.ones(2, 2)}, epoch / "model.safetensors")
    config = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [1, 2, 3], "dtype": "float32"}
    (epoch / "config.json").write_text(json.dumps(config))
    plan = resolve_layers(LAYERS, 6)
    stage_drafter(epoch, plan, tmp_path / "dflash", kind="dflash")
    published = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert published["aux_hidden_state_layer_ids"] == AUX_VLLM_IDS and published["dtype"] == "bfloat16"
    assert "eagle_aux_hidden_state_layer_ids" not in published
    with pytest.raises(TrainError, match="speculators_model_type 'dflash', expected 'eagle3'"):
        stage_drafter(epoch, plan, tmp_path / "eagle3", kind="eagle3")

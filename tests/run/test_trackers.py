"""`report_to` as HF's Trainer reads it, W&B (offline), TensorBoard and trackio (local store) read back after
`gemport sft`, and the pictures: `gemport sft --plot`'s loss curves, `gemport parity`'s report.

One `gemport sft` run of the tiny Gemma 4 of tests/cli/test_sft_cli.py (4 steps, an eval every 2) reports to W&B in
offline mode, to TensorBoard and to trackio's local store (when installed), with `run_name`: each tracker's
local files then hold HF's metric names with exactly the values of trainer_state.json, and the run config HF
uploads.
"""

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemport.errors import MissingDependencyError, RecipeError
from gemport.run import trackers
from gemport_cli import gemport, one_line_error
from sft_command import write_recipe
from pictures import assert_picture

RUN_NAME, WANDB_PROJECT, PROJECT = "tiny-run", "gemport-tests", "gemport-trackers"
REPORT_TO = ["wandb", "tensorboard"] + (["trackio"] if trackers.installed("trackio") else [])


def test_report_to_is_read_as_hf_reads_it(monkeypatch):
    from transformers.integrations import get_available_reporting_integrations

    assert trackers.names("none") == trackers.names(None) == trackers.names(["none"]) == ()
    assert trackers.names("wandb") == ("wandb",) and trackers.names(["tensorboard", "wandb"]) == ("tensorboard",
                                                                                                "wandb")
    assert trackers.names("all") == tuple(n for n in get_available_reporting_integrations() if n in trackers.MODULES)
    with pytest.raises(RecipeError, match="report_to='mlflow': gemport reports to tensorboard, wandb, trackio"):
        trackers.names("mlflow")
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    with pytest.raises(RecipeError, match="WANDB_LOG_MODEL=end"):
        trackers.names("wandb")
    monkeypatch.delenv("WANDB_LOG_MODEL")
    monkeypatch.setattr(trackers, "installed", lambda name: name != "wandb")
    with pytest.raises(MissingDependencyError, match=r"wandb is not installed; pip install 'gemport\[wandb\]'"):
        trackers.names(["tensorboard", "wandb"])
    assert "wandb" not in trackers.names("all")


def test_names_and_config_are_hfs():
    from transformers.integrations.integration_utils import rewrite_logs
    from trl import SFTConfig

    entry = {"epoch": 0.5, "grad_norm": 1.5, "learning_rate": 1e-4, "loss": 2.25, "masked_loss": 2.25, "step": 3}
    for e in (entry, {"epoch": 0.5, "eval_loss": 2.5, "eval_masked_loss": 2.5, "step": 4}):
        assert trackers.hf_names(e) == rewrite_logs({k: v for k, v in e.items() if k != "step"})
    fields = dict(output_dir="out", report_to="none", run_name=RUN_NAME, project=PROJECT, eos_token="<eos>",
                  learning_rate=5e-3, use_cpu=True)
    theirs = SFTConfig(**fields).to_dict()
    ours = trackers.sft_config_dict(fields)
    assert ours.keys() == theirs.keys()
    for key in ("run_name", "project", "learning_rate", "eos_token", "report_to", "lr_scheduler_type", "optim",
                "eval_strategy", "hub_token"):
        assert ours[key] == theirs[key], key


def test_a_tracker_or_matplotlib_missing_fails_before_anything_loads(tmp_path, monkeypatch):
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_name_or_path: {tmp_path / 'nowhere'}\ndataset_name: {tmp_path / 'none.jsonl'}\n"
                      "use_peft: true\nlora_target_modules: [q_proj]\nreport_to: wandb\n")
    monkeypatch.setattr(trackers, "installed", lambda name: name != "wandb")
    one_line_error(gemport("sft", "--config", config, ok=False), "wandb is not installed", "gemport[wandb]")
    from gemport import SFTRun

    with pytest.raises(MissingDependencyError, match="wandb is not installed"):  # before reading the base
        SFTRun.create({"report_to": ["wandb"]}, tmp_path / "nowhere", [], lora={"r": 4, "target_modules": ["q_proj"]})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    one_line_error(gemport("sft", "--config", config, "--report_to", "none", "--plot", ok=False),
                   "--plot needs matplotlib", "gemport[plot]")


def test_a_tracker_that_cannot_start_says_what_to_do(hf_checkpoint, tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    _, base = hf_checkpoint("gemma4_mesh")
    with pytest.raises(RecipeError, match=r"wandb could not start its run \(UsageError: api_key.*WANDB_MODE=offline"):
        trackers.open_trackers({"report_to": "wandb"}, base_dir=base, lora_config=None, num_parameters=1,
                               output_dir=tmp_path)


def wandb_records(path):
    """The records of a W&B ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB, each record a
    7-byte header (crc32, length, type: full 1, first 2, middle 3, last 4) and a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def key(item):
    """A W&B history or config item's name: ``key``, or ``nested_key`` joined (names with a ``/``)."""
    return item.key or "/".join(item.nested_key)


@pytest.fixture(scope="module")
def tracked(sft_workdir, tmp_path_factory):
    """`gemport sft --plot` of a TRL YAML with report_to, run_name and project; W&B offline, trackio local."""
    root = tmp_path_factory.mktemp("tracked")
    out = root / "out"
    config = write_recipe(root / "sft.yaml", sft_workdir, output_dir=str(out), save_strategy="no", report_to=REPORT_TO,
                          run_name=RUN_NAME, project=PROJECT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_PROJECT=WANDB_PROJECT, WANDB_SILENT="true",
               TRACKIO_DIR=str(root / "trackio"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "gemport", "sft", "--config", str(config), "--init-adapter",
                           str(sft_workdir / "adapter0"), "--plot"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, json.loads((out / "trainer_state.json").read_text())


def expected_logs(state):
    """What HF's W&B and trackio callbacks log for each log_history entry (transformers' own renaming)."""
    from transformers.integrations.integration_utils import rewrite_logs

    return [{**rewrite_logs({k: v for k, v in e.items() if k != "step"}), "train/global_step": e["step"]}
            for e in state["log_history"]]


def test_wandb_offline_run_holds_trainer_states_metrics_and_hfs_config(tracked):
    root, state = tracked
    (path,) = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == RUN_NAME and run.project == WANDB_PROJECT
    history = [{key(i): json.loads(i.value_json) for i in r.history.item if not key(i).startswith("_")}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [e["step"] for e in state["log_history"]] == [1, 2, 3, 3, 4, 4]  # train entries, evals at 3 and the last
    assert history == expected_logs(state)
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "train/epoch", "train/global_step",
            "eval/loss"} <= set().union(*history)

    config = {}
    for r in records:
        if r.WhichOneof("record_type") in ("run", "config"):
            update = r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update
            config.update({key(u): json.loads(u.value_json) for u in update})
    assert config["run_name"] == RUN_NAME and config["project"] == PROJECT and config["learning_rate"] == 5e-3
    assert config["report_to"] == REPORT_TO and config["eos_token"] == "<EOS_TOKEN>"
    assert config["model_type"] == "gemma4_text" and config["peft_config"]["default"]["r"] == 4
    assert config["model/num_parameters"] > 0


def test_tensorboard_events_hold_trainer_states_metrics(tracked):
    """As HF's TensorBoardCallback writes them: rewrite_logs' names at the global step, float32 scalars."""
    from tensorboardX.proto import event_pb2

    root, state = tracked
    (path,) = (root / "out" / "runs").glob("events.out.tfevents.*")
    data, pos, scalars, texts = path.read_bytes(), 0, [], set()
    while pos < len(data):  # TFRecords: uint64 length, crc, the Event, crc
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 16 + length
        for v in event.summary.value:
            if v.WhichOneof("value") == "simple_value":
                scalars.append((event.step, v.tag, v.simple_value))
            else:
                texts.add(v.tag)
    want = [(e["train/global_step"], k, np.float32(v)) for e in expected_logs(state) for k, v in e.items()
            if k != "train/global_step"]
    assert scalars == want and {"args/text_summary", "model_config/text_summary"} <= texts


def test_trackio_local_store_holds_trainer_states_metrics(tracked):
    root, state = tracked
    read = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
            f"print(json.dumps([S.get_logs({PROJECT!r}, {RUN_NAME!r}), S.get_run_config({PROJECT!r}, {RUN_NAME!r})]))")
    done = subprocess.run([sys.executable, "-c", read], env=dict(os.environ, TRACKIO_DIR=str(root / "trackio")),
                          capture_output=True, text=True, timeout=120, check=True)
    logs, config = json.loads(done.stdout.splitlines()[-1])
    assert [{k: v for k, v in e.items() if k not in ("timestamp", "step")} for e in logs] == expected_logs(state)
    assert config["run_name"] == RUN_NAME and config["peft_config"]["default"]["lora_alpha"] == 8


def test_sft_plot_draws_the_loss_curves(tracked):
    root, _ = tracked
    assert_picture(root / "out" / "loss.png", (560, 360))


def test_parity_json_holds_every_figure_and_the_picture_draws_them(tmp_path):
    from gemport.check.parity import StepRow, Tolerances, Trajectory
    from gemport.check.plots import write_parity

    rows = (StepRow(0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 1e-7, 1e-7),
            StepRow(1, 1e-3, 1e-3, 1.9, 1.9 * (1 + 3e-5), 1.0, 1.01, 1e-5, 1e-4))
    report = Trajectory(rows, Tolerances(loss=None, grad_norm=None), {"layers.0.mlp.up_proj": 2e-4},
                        adapter_floor=1e-5, floor_name="TRL eager vs sdpa attention, float32")
    numbers, picture = write_parity(report, tmp_path / "report")
    written = json.loads(numbers.read_text())
    assert not written["ok"] and written["first_disagreement"] == report.first_disagreement()
    assert written["steps"][1]["loss_port"] == rows[1].loss_port
    assert written["steps"][1]["loss_relative"] == pytest.approx(3e-5)
    assert written["steps"][1]["grad_norm_relative"] == pytest.approx(1e-2) and written["steps"][0]["loss_relative"] == 0
    assert written["tolerances"]["loss"] is None and written["steps"][1]["loss_bound"] == pytest.approx(1e-4)
    assert written["steps"][1]["grad_norm_floor"] == 1e-4 and written["floor_name"].startswith("TRL eager vs sdpa")
    assert written["adapter_tolerance"] == report.adapter_tolerance == 5e-4
    assert written["adapters"] == {"layers.0.mlp.up_proj": 2e-4} and written["adapter_floor"] == 1e-5
    assert_picture(picture, (560, 480))

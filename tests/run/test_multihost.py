"""Training past one host: each process's rows of HF's batches, and (multihost_child.py) runs under jax.distributed.

The split is tested in-process on the 8 simulated devices, grouped into two "hosts" of 4 as jax.distributed
groups them: the hosts' rows are disjoint, contiguous, and together the single-process batch, row for row.

Then 2 processes of 4 CPU devices (gloo collectives on localhost, as test_sharding_multiprocess) train a tiny
Gemma 4 (the user's nnx loop with step.train_step) and Gemma 3 (`gemport sft` on a TRL recipe, which drives
HFPeftTrainer, joining the processes with --coordinator-address/--num-processes/--process-id) with LoRA, 5
steps of 2 micro-batches of 8 rows, and 1 process of 8 devices runs the same: per-step losses and final LoRA
agree within 1e-5. Both processes then get SIGTERM mid-run; they save at one step, exit with 143, and the
rerun's trajectory is the uninterrupted 2-process run's exactly, each sample once. The exports of the 2-process
checkpoint, written on one host, are those the 2-process run wrote itself (process 0) exactly and the
single-process run's within 1e-5.
"""

import json
import os
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
import tiny
import transformers
import yaml
from jax.sharding import NamedSharding, PartitionSpec

from gemport.data import from_sft_config, optimizer_steps, pack, stack
from gemport.checkpoint import export_merged, export_peft
from gemport.checkpoint.adapters import LORA_SPEC_FILE
from gemport.errors import BatchError, RecipeError
from gemport.lora import LoraSpec
from gemport.data.distributed import batch_sharding, device_rows, global_batch, process_rows, process_step
from gemport.run.preemption import Preempted, Preemption
from ports import free_port
from chats import chats, tokenizer
from sft_recipe import CONFIG
from repo_paths import HELPERS, ROOT

HOSTS = 2


def hosts(mesh):
    """The mesh's devices as jax.distributed would give them to 2 processes of 4 (in device order)."""
    devices = list(mesh.devices.flat)
    per = len(devices) // HOSTS
    return [devices[i * per:(i + 1) * per] for i in range(HOSTS)]


def meshes():
    devices = jax.devices()
    return [jax.make_mesh((8, 1), ("fsdp", "tp"), devices=devices),
            jax.make_mesh((2, 4), ("fsdp", "tp"), devices=devices)]


@pytest.mark.parametrize("mesh", meshes(), ids=["fsdp8", "fsdp2_tp4"])
def test_each_host_holds_one_range_of_rows(mesh):
    sharding = batch_sharding(mesh)
    shape = (2, 8, 12)
    parts = [device_rows(sharding, shape, group) for group in hosts(mesh)]
    assert parts == [slice(0, 4), slice(4, 8)]
    assert process_rows(sharding, shape) == slice(0, 8)  # one process here: all of them


def test_rows_that_are_not_one_range_are_refused():
    mesh = meshes()[1]
    # Rows over (tp, fsdp): the first host's devices (fsdp 0, every tp) hold rows 0, 2, 4, 6.
    sharding = NamedSharding(mesh, PartitionSpec(None, ("tp", "fsdp"), None))
    with pytest.raises(BatchError, match=r"rows \[0, 2, 4, 6\] of 8"):
        device_rows(sharding, (2, 8, 12), hosts(mesh)[0])


def packed_rows(n=23, seed=1):
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(1, 96, int(k)).astype(np.int32) for k in rng.integers(4, 13, n)]
    return pack([(t, np.arange(len(t)) >= len(t) // 2) for t in tokens], 12)


def test_hosts_rows_are_the_single_process_batches():
    rows = packed_rows()
    args = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=2, seed=5)
    mesh = meshes()[0]
    sharding = batch_sharding(mesh)
    steps = list(optimizer_steps(args, len(rows["tokens"])))
    assert len(steps[-1].micro_batches[-1]) < 8  # a short last micro-batch: one host gets fewer rows, or none

    def batch(step, count):
        return stack([{k: v[m] for k, v in rows.items()} for m in step.micro_batches], accumulation=2, rows=count)

    for step in steps:
        whole = batch(step, 8)
        parts = []
        for group in hosts(mesh):
            mine = device_rows(sharding, whole["tokens"].shape, group)
            parts.append(batch(process_step(step, mine), mine.stop - mine.start))
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts], axis=1), whole[k], err_msg=k)
        joined = global_batch(whole, sharding, 8)  # one process: its local rows are the global batch
        assert joined["tokens"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(joined["tokens"]), whole["tokens"])


@pytest.mark.parametrize("layout", [{}, {"packing": False}])
def test_sft_pipeline_lays_out_only_a_hosts_rows(layout):
    config = {**CONFIG, **layout, "per_device_train_batch_size": 4, "max_steps": 5}
    pipeline = from_sft_config(config, tokenizer())
    examples, _ = pipeline.examples(chats(), tokenizer(), progress=False)
    whole = list(pipeline.batches(examples))
    parts = [list(pipeline.batches(examples, rows=rows)) for rows in (slice(0, 2), slice(2, 4))]
    assert len(whole) == len(parts[0]) == len(parts[1]) == 5
    for (step, batch), (step0, part0), (step1, part1) in zip(whole, *parts):
        assert part0["tokens"].shape == (2, 2, batch["tokens"].shape[-1])
        for a, m in enumerate(step.micro_batches):
            np.testing.assert_array_equal(np.concatenate([step0.micro_batches[a], step1.micro_batches[a]]), m)
        for k in batch:
            np.testing.assert_array_equal(np.concatenate([part0[k], part1[k]], axis=1), batch[k], err_msg=k)
    free = from_sft_config({**config, "packing": False, "padding_free": True}, tokenizer())
    with pytest.raises(RecipeError, match="padding_free"):
        next(free.batches(examples, rows=slice(0, 1)))


def test_sigterm_on_one_process_stops_at_the_next_check():
    saved = []
    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as preemption:
        preemption.check(1, lambda: saved.append(1))
        assert saved == []  # no signal: the run goes on
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process lives on to the step boundary
        with pytest.raises(Preempted, match=r"step 2 in ckpt .*run the same command again") as stopped:
            preemption.check(2, lambda: saved.append(2), where="ckpt")
    assert saved == [2] and stopped.value.step == 2 and Preempted.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


CHILD = HELPERS / "multihost_child.py"
TERM_AFTER = 2
STEPS = 5


def launch(out, jobs, processes):
    """Run multihost_child.py as ``processes`` processes (8 devices between them); their return codes and stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(out / "jax-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes} "
                         "--xla_cpu_collective_call_terminate_timeout_seconds=900")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port = free_port()
    procs, logs = [], []
    for pid in range(processes):
        # Output goes to files: a full pipe would block one process, and the other then waits for it.
        err = out / f"err-{port}-{pid}"
        logs.append(err)
        with err.open("w") as stderr:
            procs.append(subprocess.Popen([sys.executable, str(CHILD), str(port), str(pid), str(processes), str(out),
                                           *jobs], env=env, stdout=subprocess.DEVNULL, stderr=stderr, cwd=CHILD.parent))
    try:
        for proc in procs:
            proc.wait(timeout=900)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [proc.returncode for proc in procs], [err.read_text() for err in logs]


# The `gemport sft` recipe: the nnx loop's steps (multihost_child.ARGS) on chats, evaluated at the start and end.
SFT = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
           lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], assistant_only_loss=True,
           packing=True, max_length=96, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=STEPS,
           learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=1, seed=7,
           adam_epsilon=1e-3, bf16=False, logging_steps=1, save_steps=2, save_total_limit=2, eval_strategy="steps",
           eval_steps=STEPS, per_device_eval_batch_size=8, disable_tqdm=True)


def shallow(name, directory, **fields):
    """tests/helpers/tiny.py's config ``name`` with 2 layers (``fields`` on top), random, saved to ``directory``.

    What these runs assert (the processes train as one, a rerun continues exactly, the exports agree) holds at
    any depth; each of the runs' 7 processes traces and compiles its steps (and Qwix's first call), which cost
    about in proportion to the layers.
    """
    kwargs = {**tiny.TEXT_CONFIGS[name], "num_hidden_layers": 2, **fields}
    gemma4 = kwargs.pop("model_type") == "gemma4_text"
    config = (transformers.Gemma4TextConfig if gemma4 else transformers.Gemma3TextConfig)(**kwargs)
    config._attn_implementation = "eager"
    model = (transformers.Gemma4ForCausalLM if gemma4 else transformers.Gemma3ForCausalLM)(config)
    tiny.randomize(model).save_pretrained(directory)
    return directory


def sft_recipe(root):
    """A tiny Gemma 3 (its vocabulary fits the test tokenizer) with that tokenizer, train/test chats, the YAML."""
    base = shallow("gemma3_vllm", root / "gemma3")
    tokenizer().save_pretrained(base)
    data = root / "chats"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(24)))
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(12, seed=1)))
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": str(base), "dataset_name": str(data), **SFT}))
    return base, config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs' output root: one-NAME (1 process), two-NAME (2 processes), term-NAME (2, SIGTERMed, rerun).

    Gemma 4 is the 31B layout (k_eq_v), one sliding and one global layer; Gemma 3 two sliding layers (Tunix's
    fixed 5:1 pattern)."""
    out = tmp_path_factory.mktemp("multihost")
    g4 = shallow("gemma4_dense", out / "gemma4", layer_types=["sliding_attention", "full_attention"])
    g3, config = sft_recipe(out)
    # Each 2-process launch ends with the job its SIGTERM stops; `gemport sft`, joining the processes, starts it.
    first = launch(out, [f"sft:{config}:two-g3", f"nnx:{g4}:two-g4", f"nnx:{g4}:term-g4:{TERM_AFTER}"], 2)
    second = launch(out, [f"sft:{config}:term-g3:{TERM_AFTER}"], 2)
    third = launch(out, [f"sft:{config}:term-g3", f"nnx:{g4}:term-g4"], 2)
    one = launch(out, [f"sft:{config}:one-g3", f"nnx:{g4}:one-g4"], 1)
    stops = {}
    for name, (codes, errors) in (("g4", first), ("g3", second)):
        assert codes == [128 + signal.SIGTERM] * 2, [e[-3000:] for e in errors]
        stops[name] = {int(m) for e in errors for m in re.findall(r"saved the checkpoint of step (\d+)", e)}
    for codes, errors in (third, one):
        assert codes == [0] * len(codes), [e[-3000:] for e in errors]
    return out, {"g4": g4, "g3": g3}, stops


def log(run):
    """Each trained step's record: the nnx loop's log.jsonl, or `gemport sft`'s log_history (train entries)."""
    if (run / "trainer_state.json").is_file():
        history = json.loads((run / "trainer_state.json").read_text())["log_history"]
        return [e for e in history if "loss" in e]
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def lora(run):
    """The final LoRA factors: the nnx loop's lora.npz, or the PEFT adapter `gemport sft` left."""
    if (run / "adapter_model.safetensors").is_file():
        return safetensors.numpy.load_file(run / "adapter_model.safetensors")
    with np.load(run / "lora.npz") as f:
        return dict(f)


@pytest.mark.parametrize("name", ["g4", "g3"])
def test_two_processes_train_as_one(runs, name):
    out, _, _ = runs
    one, two = log(out / f"one-{name}"), log(out / f"two-{name}")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    floats = ("loss", "grad_norm", "masked_loss", "full_sequence_loss")
    assert [{k: v for k, v in r.items() if k not in floats} for r in two] == \
        [{k: v for k, v in r.items() if k not in floats} for r in one]  # the same samples (epochs, schedule)
    # The same arithmetic with the sums over rows and devices reduced in another order: float32 rounding.
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=0, atol=1e-5)
    a, b = lora(out / f"one-{name}"), lora(out / f"two-{name}")
    assert sorted(a) == sorted(b) and len(a) > 0
    for k in a:
        assert np.abs(a[k]).max() > 0
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("name", ["g4", "g3"])
def test_sigterm_then_rerun_continues_exactly(runs, name):
    out, _, stops = runs
    # Both processes stopped after one step, at or after the SIGTERM, before the end, and saved it.
    (stop,) = stops[name]
    assert TERM_AFTER <= stop < STEPS
    expected, got = log(out / f"two-{name}"), log(out / f"term-{name}")
    assert got == expected  # losses bit-identical, each step (and its samples) once and in order
    a, b = lora(out / f"two-{name}"), lora(out / f"term-{name}")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def tensors(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(safetensors.numpy.load_file(file))
    return out


def test_sft_across_processes_evaluates_on_every_row(runs):
    out, _, _ = runs
    evals = [[e for e in json.loads((out / f"{n}-g3" / "trainer_state.json").read_text())["log_history"]
              if "eval_loss" in e] for n in ("one", "two")]
    assert [e["step"] for e in evals[1]] == [STEPS]
    np.testing.assert_allclose(evals[1][0]["eval_loss"], evals[0][0]["eval_loss"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("export, written", [(export_merged, "merged"), (export_peft, ".")])
def test_exports_of_a_two_process_checkpoint(runs, tmp_path, export, written):
    out, base, _ = runs
    root = out / "two-g3" / "checkpoints"
    assert LoraSpec.from_json((root / LORA_SPEC_FILE).read_text()).rank == 4  # recorded once, by process 0
    two = tensors(export(root, tmp_path / "two", base_dir=base["g3"]))
    by_run = tensors(out / "two-g3" / written)  # what `gemport sft` wrote at the end, from process 0
    one = tensors(export(out / "one-g3" / "checkpoints", tmp_path / "one", base_dir=base["g3"]))
    assert sorted(two) == sorted(by_run) == sorted(one)
    for k in two:
        np.testing.assert_array_equal(two[k], by_run[k], err_msg=k)  # the checkpoint holds every shard
        np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-5, err_msg=k)

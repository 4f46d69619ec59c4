"""Training data at scale: time to the first step (cold and cached), peak RSS per process and tokens/s, beside TRL.

For each size (default 10k, 100k and 1M synthetic conversations of bench_masks.py, written once to a .jsonl file),
each measurement runs in a fresh process:

Each clock starts where a run's data stage does (the recipe read, its libraries imported) and stops at the first
micro-batch in hand.

- gemport cold: an empty cache; ``SFTPipeline.prepared`` (render, tokenize, mask, truncate, pack on every core:
  forked workers) then the first micro-batch of ``run.trainer.micro_batches`` through ``prefetched``: what
  ``SFTRun``'s data stage does before the first step;
- gemport cached: the same in a new process, reading the cache (what a rerun, a resume or another host does),
  then the loader's tokens/s: micro-batches read in order through the prefetching thread, as the trainer reads them;
- TRL cold / cached: ``datasets.load_dataset("json")`` and ``SFTTrainer``'s dataset preparation (tokenization with
  its Gemma 3 training template and assistant masks, packing) with ``dataset_num_proc`` = the same number of
  processes, then the first batch of its train dataloader; cached: the same again, ``datasets`` reading its own
  cache (the Arrow file and every ``map``'s result).

The recipe: ``assistant_only_loss``, ``packing`` at ``max_length`` 1024, 8 rows x 4 micro-batches a step. Peak RSS
is ``ru_maxrss`` of the process and of its largest child (the workers). Ratios are TRL's over gemport's (time) and
gemport's over TRL's (tokens/s). TRL's sizes are capped by ``--trl-max`` (its template path runs at a few hundred
thousand tokens/s a process); what is not measured is said. ``--record`` appends one JSON line per size.

    python bench/bench_data.py [--sizes 10000 100000 1000000] [--trl-max 100000] [--record bench/data_scale.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = dict(assistant_only_loss=True, packing=True, max_length=1024, per_device_train_batch_size=8,
              gradient_accumulation_steps=4, num_train_epochs=1, seed=0, report_to="none", use_cpu=True, bf16=False,
              save_strategy="no")
LOADER_SECONDS = 15.0  # how long the loader is read to measure its tokens/s


def _chunk(args):
    # One slice of the synthetic data, seeded by its index: the file is the same whatever the core count.
    from bench_masks import conversation

    index, count = args
    rng = random.Random(index)
    lines = []
    for _ in range(count):
        chat = [{k: v for k, v in m.items() if k != "reasoning"} for m in conversation(rng)]
        lines.append(json.dumps({"messages": chat}))
    return "\n".join(lines) + "\n"


def write_data(path: Path, n: int) -> None:
    """``n`` synthetic conversations (bench_masks.conversation, without reasoning) as a .jsonl, written once."""
    if path.is_file():
        return
    step = 10_000
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f, multiprocessing.Pool(os.cpu_count()) as pool:
        for text in pool.imap(_chunk, [(i, min(step, n - i)) for i in range(0, n, step)]):
            f.write(text)
    os.replace(tmp, path)


def write_tokenizer(path: Path) -> None:
    """bench_masks' BPE tokenizer with Gemma 3's control tokens, TRL's Gemma 3 training template, bos and eos."""
    if (path / "tokenizer.json").is_file():
        return
    from bench_masks import tokenizer
    from trl.chat_template_utils import gemma3_training_chat_template

    tok = tokenizer(random.Random(0))
    tok.add_special_tokens({"bos_token": "<bos>", "eos_token": "<end_of_turn>"})
    tok.chat_template = gemma3_training_chat_template
    tok.save_pretrained(path)


def peak_rss() -> dict[str, float]:
    """Peak RSS in MiB of this process and of its largest child (ru_maxrss is in KiB on Linux)."""
    return {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def gemport_phase(data: Path, tok_dir: Path, cache: Path, workers: int, loader_seconds: float) -> dict:
    """gemport's data stage to the first micro-batch, then the loader's tokens/s over ``loader_seconds``."""
    from transformers import AutoTokenizer

    from gemport.data import Gemma3, from_sft_config
    from gemport.recipe import defaults
    from gemport.run.trainer import micro_batches, prefetched

    defaults("SFTConfig")  # TRL imported, as SFTRun has it by its data stage (the recipe read)
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    pipeline = from_sft_config(CONFIG, tok, chat_format=Gemma3())
    prepared = pipeline.prepared(data, tok, root=cache, workers=workers, progress=False)
    ready = time.perf_counter()
    steps = pipeline.steps(prepared.examples, placement=prepared.placement)
    accumulation = steps.shape[0]
    reader = iter(prefetched(micro_batches(steps), 2 * accumulation))
    first = next(reader)
    first_step = time.perf_counter() - start
    tokens, count, began = int((first["segment_ids"] > 0).sum()), 1, time.perf_counter()
    while time.perf_counter() - began < loader_seconds and count < len(steps) * accumulation:
        tokens += int((next(reader)["segment_ids"] > 0).sum())
        count += 1
    loader = tokens / max(time.perf_counter() - began, 1e-9)
    return {"prepare_s": ready - start, "first_step_s": first_step, "tokens": prepared.manifest["tokens"],
            "examples": len(prepared.examples), "rows": prepared.placement.rows, "steps": len(steps),
            "loader_tokens_per_s": loader, "loader_micro_batches": count, "rss_mib": peak_rss()}


def trl_phase(data: Path, tok_dir: Path, workdir: Path, workers: int) -> dict:
    """TRL's data preparation (``datasets.load_dataset`` + ``SFTTrainer``'s) to the first batch of its loader."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    config = transformers.Gemma3TextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                           head_dim=16)
    model = transformers.Gemma3ForCausalLM(config)
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    loaded = time.perf_counter()
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(workdir / "trl-out"), dataset_num_proc=workers,
                                                     **CONFIG), train_dataset=dataset, processing_class=tok)
    ready = time.perf_counter()
    next(iter(trainer.get_train_dataloader()))
    first_step = time.perf_counter() - start
    tokens = sum(sum(lengths) for lengths in trainer.train_dataset["seq_lengths"])
    return {"load_s": loaded - start, "prepare_s": ready - start, "first_step_s": first_step, "tokens": tokens,
            "rows": len(trainer.train_dataset), "rss_mib": peak_rss()}


def run_phase(phase: str, n: int, args) -> dict:
    """One phase in a fresh process (its peak RSS its own); returns its JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
               HF_DATASETS_CACHE=str(args.workdir / f"hf-datasets-{n}"), TOKENIZERS_PARALLELISM="false",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, __file__, "--phase", phase, "--n", str(n), "--workdir", str(args.workdir),
                           "--workers", str(args.workers)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{phase} {n}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(n: int, args) -> dict:
    """Every phase of one size: gemport cold and cached, TRL cold and cached (below ``--trl-max``)."""
    data = args.workdir / f"chats-{n}.jsonl"
    write_data(data, n)
    shutil.rmtree(args.workdir / f"cache-{n}", ignore_errors=True)
    out = {"n": n, "workers": args.workers, "file_mib": data.stat().st_size / 2**20,
           "gemport_cold": run_phase("gemport-cold", n, args), "gemport_cached": run_phase("gemport-cached", n, args)}
    if n <= args.trl_max:
        shutil.rmtree(args.workdir / f"hf-datasets-{n}", ignore_errors=True)
        out["trl_cold"] = run_phase("trl", n, args)
        out["trl_cached"] = run_phase("trl", n, args)
    return out


def report(r: dict) -> None:
    """Print one size's figures and their ratios against TRL."""
    cold, cached = r["gemport_cold"], r["gemport_cached"]
    print(f"\n{r['n']:,} conversations ({r['file_mib']:.0f} MiB .jsonl), {cold['tokens']:,} tokens, "
          f"{cold['examples']:,} examples, {cold['rows']:,} packed rows, {cold['steps']:,} steps; {r['workers']} "
          "processes each side")
    print(f"  gemport cold:   first step {cold['first_step_s']:8.1f} s, {cold['tokens'] / cold['prepare_s']:>12,.0f} "
          f"tokens/s, peak RSS {cold['rss_mib']['self']:.0f} MiB (workers {cold['rss_mib']['children']:.0f} MiB)")
    print(f"  gemport cached: first step {cached['first_step_s']:8.2f} s, peak RSS {cached['rss_mib']['self']:.0f} "
          f"MiB; loader {cached['loader_tokens_per_s']:,.0f} tokens/s over {cached['loader_micro_batches']} "
          "micro-batches")
    if "trl_cold" not in r:
        print(f"  TRL: not measured at this size (--trl-max): about {r['n'] / 100_000:.0f}x its 100k time")
        return
    for kind in ("cold", "cached"):
        trl, ours = r[f"trl_{kind}"], r[f"gemport_{kind}"]
        print(f"  TRL {kind + ':':8} first step {trl['first_step_s']:8.2f} s (load_dataset {trl['load_s']:.1f} s), "
              f"peak RSS {trl['rss_mib']['self']:.0f} MiB (workers {trl['rss_mib']['children']:.0f} MiB); "
              f"time ratio TRL/gemport {trl['first_step_s'] / ours['first_step_s']:.2f}x")
    print(f"  cold preparation tokens/s, gemport/TRL: "
          f"{(cold['tokens'] / cold['prepare_s']) / (r['trl_cold']['tokens'] / r['trl_cold']['prepare_s']):.2f}x")


def table(records: list[dict]) -> str:
    """docs/benchmarks.md's tables of recorded sizes (``--record``'s lines): time to the first step, then memory
    and throughput; "not run" where TRL was not measured."""

    def speed(side):
        return side["tokens"] / side["prepare_s"]

    def rss(side):
        return f"{side['rss_mib']['self']:.0f} MiB ({side['rss_mib']['children']:.0f} MiB)"

    first = ["| conversations | tokens | gemport cold | TRL cold | TRL / gemport | gemport cached | TRL cached | "
             "TRL / gemport |", "|---|---|---|---|---|---|---|---|"]
    second = ["| conversations | preparation, gemport | TRL | gemport / TRL | peak RSS cached, gemport | TRL | "
              "peak RSS cold, gemport (workers) | TRL (workers) | loader |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        cold, cached = r["gemport_cold"], r["gemport_cached"]
        trl_cold, trl_cached = r.get("trl_cold"), r.get("trl_cached")
        if trl_cold:
            times = [f"{trl_cold['first_step_s']:.1f} s", f"{trl_cold['first_step_s'] / cold['first_step_s']:.1f}x",
                     f"{trl_cached['first_step_s']:.2f} s",
                     f"{trl_cached['first_step_s'] / cached['first_step_s']:.1f}x"]
            others = [f"{speed(trl_cold) / 1e3:,.0f} k tokens/s", f"{speed(cold) / speed(trl_cold):.2f}x",
                      f"{trl_cached['rss_mib']['self']:.0f} MiB", rss(trl_cold)]
        else:
            times, others = ["not run", "", "not run", ""], ["not run", "", "not run", "not run"]
        first.append(f"| {r['n']:,} | {cold['tokens'] / 1e6:.1f} M | {cold['first_step_s']:.1f} s | {times[0]} | "
                     f"{times[1]} | {cached['first_step_s']:.2f} s | {times[2]} | {times[3]} |")
        second.append(f"| {r['n']:,} | {speed(cold) / 1e3:,.0f} k tokens/s | {others[0]} | {others[1]} | "
                      f"{cached['rss_mib']['self']:.0f} MiB | {others[2]} | {rss(cold)} | {others[3]} | "
                      f"{cached['loader_tokens_per_s'] / 1e6:.1f} M tokens/s |")
    return "\n".join(first + [""] + second)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--trl-max", type=int, default=100_000, help="the largest size TRL is measured at")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gemport-bench-data"))
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--record", type=Path, help="append one JSON line per size to this file")
    parser.add_argument("--phase", choices=("gemport-cold", "gemport-cached", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    tok_dir = args.workdir / "tokenizer"
    if args.phase:
        data = args.workdir / f"chats-{args.n}.jsonl"
        cache = args.workdir / f"cache-{args.n}"
        result = {"gemport-cold": lambda: gemport_phase(data, tok_dir, cache, args.workers, 0.0),
                  "gemport-cached": lambda: gemport_phase(data, tok_dir, cache, args.workers, LOADER_SECONDS),
                  "trl": lambda: trl_phase(data, tok_dir, args.workdir, args.workers)}[args.phase]()
        print(json.dumps(result))
        return
    write_tokenizer(tok_dir)
    records = []
    for n in args.sizes:
        records.append(measure(n, args))
        report(records[-1])
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps({**records[-1], "cpus": os.cpu_count(),
                                    "date": datetime.date.today().isoformat()}) + "\n")
    print("\n" + table(records))


if __name__ == "__main__":
    main()

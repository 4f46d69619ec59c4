"""Qwix LoRA parameters from where Tunix leaves them, as `LoraParams` (factors with their `LoraSpec`).

Sources: an nnx model or state (``nnx.LoRAParam``), a flat ``{path: array}`` dict, `LoraParams`, or an Orbax
checkpoint written by Tunix's PeftTrainer with ``save_only_lora_params`` (``<root>/<step>/model_params``).
Tunix does not record rank, alpha or targets; `save_lora_spec` writes them beside the checkpoint root so that
`load_lora` and the exports can find them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from flax import nnx

import jax
import orbax.checkpoint as ocp

from gemport.checkpoint.orbax import save_orbax, stored_tree
from gemport.checkpoint.output import atomic_dir, check_output
from gemport.errors import CheckpointError, CorruptFileError, LoraError
from gemport.lora import LoraParams, LoraSpec
from gemport._src.params import flat_params, lora_state

LORA_SPEC_FILE = "gemport_lora.json"
PARAMS_DIR = "model_params"


def params_dir(path: str | os.PathLike, *, step: int | None = None) -> Path:
    """The ``model_params`` directory of a PeftTrainer checkpoint root, step directory, or itself."""
    path = Path(path)
    if path.name == PARAMS_DIR:
        return path
    if (path / PARAMS_DIR).is_dir():
        return path / PARAMS_DIR
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / PARAMS_DIR).is_dir()) \
        if path.is_dir() else []
    if not steps:
        raise CheckpointError(
            f"{path}: no <step>/{PARAMS_DIR} here; pass the checkpoint root of Tunix's PeftTrainer, a step "
            f"directory or a {PARAMS_DIR} directory"
        )
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise CheckpointError(f"{path}: no step {step}; steps present: {steps}")
    return path / str(step) / PARAMS_DIR


def _read_orbax(path: str | os.PathLike, *, step: int | None = None) -> dict[str, np.ndarray]:
    """The LoRA params of a PeftTrainer Orbax checkpoint, as host numpy arrays (no model or mesh needed)."""
    directory = params_dir(path, step=step).resolve()
    checkpointer = ocp.PyTreeCheckpointer()
    tree = stored_tree(checkpointer, directory)
    restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    try:
        restored = checkpointer.restore(directory, args=ocp.args.PyTreeRestore(restore_args=restore))
    except Exception as e:
        raise CorruptFileError(f"{directory}: Orbax could not read the checkpoint's arrays ({e})") from None
    out = {}
    for keys, value in jax.tree_util.tree_flatten_with_path(restored)[0]:
        parts = [str(getattr(k, "key", getattr(k, "idx", k))) for k in keys]
        if parts[-1] == "value":  # nnx.Variable leaves are saved as {"value": array}
            parts = parts[:-1]
        out[".".join(parts)] = np.asarray(value)
    return {k: v for k, v in out.items() if k.endswith(("_lora_a", "_lora_b"))}


def save_lora_spec(root: str | os.PathLike, lora_spec: LoraSpec) -> Path:
    """Record ``lora_spec`` as ``<root>/gemport_lora.json`` beside a checkpoint (atomically).

    Under ``jax.distributed`` only process 0 writes, as Orbax writes a checkpoint's metadata; every process
    gets the path.
    """
    root = Path(root)
    path = root / LORA_SPEC_FILE
    if jax.process_index() != 0:
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{LORA_SPEC_FILE}.{os.getpid()}"
    tmp.write_text(lora_spec.to_json())
    os.replace(tmp, path)
    return path


def _find_lora_spec(path: str | os.PathLike) -> LoraSpec | None:
    """The LoraSpec recorded by `save_lora_spec` for a checkpoint root, step or ``model_params`` path."""
    path = Path(path).resolve()
    for directory in (path, path.parent, path.parent.parent):
        file = directory / LORA_SPEC_FILE
        if file.is_file():
            try:
                return LoraSpec.from_json(file.read_bytes().decode())
            except (ValueError, TypeError, KeyError) as e:
                raise LoraError(f"{file}: not a LoraSpec as save_lora_spec writes it ({e}); write it again with "
                                "save_lora_spec, or remove it and pass the LoraSpec") from None
    return None


def load_lora(source, *, lora_spec: LoraSpec | None = None, step: int | None = None) -> LoraParams:
    """LoRA factors and their spec from wherever they are.

    Args:
      source: `LoraParams`; an nnx model with Qwix LoRA or its ``nnx.State``; a flat
        ``{"layers.0.attn.q_einsum.w_lora_a": array}`` dict; or a path: a PeftTrainer checkpoint root, one of
        its step directories, or a ``model_params`` directory.
      lora_spec: rank, alpha and targets; default the spec ``source`` carries (`LoraParams`, a model from
        `gemport.lora.apply_lora`) or the one `save_lora_spec` recorded beside an Orbax checkpoint.
      step: with a checkpoint root, the step to read; default the latest.

    Returns:
      `LoraParams` with host (numpy) values.

    Raises:
      CheckpointError: no such checkpoint or step. LoraError: no spec given or recorded.
    """
    where = ""
    if isinstance(source, LoraParams):
        lora_spec = lora_spec or source.lora_spec
        source = source.params
    if isinstance(source, nnx.Module):
        lora_spec = lora_spec or getattr(source, "lora_spec", None)
    if isinstance(source, (str, os.PathLike)):
        directory = params_dir(source, step=step)  # a missing checkpoint is reported before a missing spec
        lora_spec = lora_spec or _find_lora_spec(directory)
        where = f"{source}: "
    if lora_spec is None:
        raise LoraError(
            f"{where}no LoraSpec: Tunix does not store rank, alpha or targets; pass lora_spec=LoraSpec(...), or "
            "record it when training with gemport.checkpoint.save_lora_spec(checkpoint_root, lora_spec)"
        )
    if isinstance(source, (str, os.PathLike)):
        flat = _read_orbax(source, step=step)
    else:
        if isinstance(source, (nnx.Module, nnx.State)):
            source = flat_params(source, nnx.LoRAParam)
        flat = {k: np.asarray(v) for k, v in source.items() if k.endswith(("_lora_a", "_lora_b"))}
    return LoraParams(lora_state(flat), lora_spec)


def save_lora(lora: LoraParams, out_dir: str | os.PathLike, *, step: int = 0) -> Path:
    """Write ``lora`` as a PeftTrainer checkpoint root: ``<out_dir>/<step>/model_params`` and its spec.

    Tunix's ``PeftTrainer`` (``CheckpointManager.maybe_restore(..., restore_only_lora_params=True)``) resumes
    from it, and `load_lora` and the exports read it back. The directory appears atomically when complete.

    Args:
      lora: the factors and their spec (`LoraParams`, e.g. from `load_lora` or `SFTRun.lora_params`). The
        factors are written as Orbax stores them (`save_orbax`), in their own shapes and dtypes.
      out_dir: the checkpoint root to create; must not exist or be empty.
      step: the step directory's name, ``<out_dir>/<step>``.

    Returns:
      The path of the checkpoint root, resolved: ``<step>/model_params`` (the Orbax checkpoint of
      ``lora.params``) and ``gemport_lora.json`` (``lora.lora_spec``, `save_lora_spec`).

    Raises:
      CheckpointError: ``out_dir`` exists and is not empty, is not writable, or Orbax failed.

    Example (``checkpoint``: a tiny Gemma 3 saved by transformers):

      >>> import tempfile
      >>> import numpy as np
      >>> from gemport import GemmaSpec, LoraLayout, LoraSpec, load_lora, save_lora
      >>> lora_spec = LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj"))
      >>> shapes = LoraLayout(GemmaSpec.from_hf(checkpoint), lora_spec).shapes()
      >>> rng = np.random.default_rng(0)
      >>> factors = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
      >>> tmp = tempfile.TemporaryDirectory()
      >>> root = save_lora(load_lora(factors, lora_spec=lora_spec), f"{tmp.name}/adapter")
      >>> sorted(str(p.relative_to(root)) for p in root.glob("*/*")) + sorted(p.name for p in root.glob("*.json"))
      ['0/model_params', 'gemport_lora.json']
      >>> back = load_lora(root)  # the latest step, with the recorded spec
      >>> back.lora_spec == lora_spec, all(np.array_equal(back.flat()[k], v) for k, v in factors.items())
      (True, True)
      >>> tmp.cleanup()
    """
    out = check_output(out_dir)
    with atomic_dir(out) as tmp:
        save_orbax(lora.params, tmp / str(step) / PARAMS_DIR)
        save_lora_spec(tmp, lora.lora_spec)
    return out

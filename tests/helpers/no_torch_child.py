"""A TPU VM's Python, simulated: torch, TRL, PEFT, accelerate (and bitsandbytes, torchvision) cannot be imported,
as on a host that installed ``gemport[tpu]`` only. Runs gemport commands in this process and reports.

    python no_torch_child.py PLAN.json RESULT.json

PLAN: ``{"commands": [[argv...], ...], "tokenize": {"records": PATH, "recipe": {SFTConfig fields}, "base": DIR}}``;
RESULT: each command's exit status and the last line it wrote to stderr, the token ids and loss masks of
``tokenize`` (through ``from_sft_config``), and any blocked module that was imported anyway.
"""

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import sys

BLOCKED = {"torch", "trl", "peft", "accelerate", "bitsandbytes", "torchvision"}


def _blocked(name):
    return name.replace("-", "_").split(".")[0] in BLOCKED


class _NotInstalled:
    """A meta path finder that answers for the blocked packages as Python does for a package that is absent."""

    def find_spec(self, name, path=None, target=None):
        if _blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


# Libraries probe for optional packages with find_spec and their metadata before importing them: both say absent.
sys.meta_path.insert(0, _NotInstalled())
_find_spec, _version, _distribution = importlib.util.find_spec, importlib.metadata.version, importlib.metadata.distribution


def _absent(lookup):
    def wrapped(name, *args):
        if _blocked(name):
            raise importlib.metadata.PackageNotFoundError(name)
        return lookup(name, *args)
    return wrapped


importlib.util.find_spec = lambda name, package=None: None if _blocked(name) else _find_spec(name, package)
importlib.metadata.version = _absent(_version)
importlib.metadata.distribution = _absent(_distribution)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(plan_path, result_path):
    plan = json.loads(open(plan_path).read())
    from gemport.cli import main as gemport

    results = []
    for argv in plan["commands"]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                status = gemport(argv)
            except SystemExit as e:
                status = e.code
        lines = [line for line in err.getvalue().replace("\r", "\n").splitlines() if line.strip()]
        results.append({"argv": argv, "status": status, "last": lines[-1] if lines else ""})
    out = {"commands": results}
    if "tokenize" in plan:
        import transformers

        from gemport.data import from_sft_config

        job = plan["tokenize"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(job["base"])
        examples, _ = from_sft_config(job["recipe"], tokenizer).examples(job["records"], tokenizer, progress=False)
        out["tokens"] = [e.tokens.tolist() for e in examples]
        out["loss_mask"] = [e.loss_mask.tolist() for e in examples]
    out["imported"] = sorted(m for m in sys.modules if _blocked(m))
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])

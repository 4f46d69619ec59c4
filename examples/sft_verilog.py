"""``gemport sft`` on the bundled Verilog chats with a ``trl sft`` YAML (examples/sft_verilog.yaml), on CPU.

The YAML names the real Gemma 4 31B; on a CPU this runs it on a random miniature of the same layout (built as
examples/port_gemma4.py builds it), overriding only ``model_name_or_path``, ``output_dir``, ``dtype`` and the
number of steps, as one would on the command line:

    python examples/sft_verilog.py [--out DIR] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if "jax" not in sys.modules and not os.environ.get("JAX_PLATFORMS"):
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"

HERE = Path(__file__).parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="working directory (default: a new temporary one)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    from port_gemma4 import DATA, tiny_checkpoint

    import transformers

    from gemport.cli import main as gemport
    from gemport.data.training_template import gemma4_training_template

    work = args.out or Path(tempfile.mkdtemp(prefix="gemport-sft-"))
    base = work / "base"
    if not base.is_dir():
        tiny_checkpoint(base, [json.loads(line)["messages"] for line in DATA.read_text().splitlines()])
        # A chat template with {% generation %} markers, as assistant_only_loss needs in TRL too.
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
        tokenizer.chat_template = gemma4_training_template()
        tokenizer.save_pretrained(base)
    os.chdir(HERE.parent)  # dataset_name in the YAML is relative to the repository
    return gemport(["sft", "--config", str(HERE / "sft_verilog.yaml"), "--model_name_or_path", str(base),
                    "--output_dir", str(work / "gemma4-verilog-lora"), "--dtype", "float32",
                    "--max_steps", str(args.steps), "--merge"])


if __name__ == "__main__":
    sys.exit(main())

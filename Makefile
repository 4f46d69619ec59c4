# One venv per checkout; the constraints file pins every package so a fresh install is reproducible.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

LATEST ?= .venv-latest
LATEST_STAMP := $(LATEST)/.installed

.PHONY: demo test test-latest bench docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/port_gemma4.py

test: $(STAMP)
	$(PY) -m pytest -q
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
	$(LATEST)/bin/python -m pytest -q
	$(LATEST)/bin/mkdocs build --strict --quiet --site-dir build/site-latest

bench: $(STAMP)
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(LATEST) build .pytest_cache

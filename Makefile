# One venv per checkout; the constraints file pins every package so a fresh install is reproducible.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench docs clean

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

bench: $(STAMP)
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build .pytest_cache

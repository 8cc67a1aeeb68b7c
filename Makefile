# Two entry points, both usable on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs. On CPU machines torch is pinned
# to exactly 2.13.0 in the same pip call as everything else (constraints file), so no package
# can pull another torch.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
REQS    := requirements/base.txt requirements/constraints-cpu.txt pyproject.toml

.PHONY: demo test venv clean compose-check

venv: $(STAMP)

$(STAMP): $(REQS)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements/base.txt -c requirements/constraints-cpu.txt
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VPY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m bench.demo

test: $(STAMP)
	$(VPY) -m pytest -q tests

# The mesh for real under Docker, CPU only (not part of test): scripts/compose-check.sh.
compose-check: $(STAMP)
	bash scripts/compose-check.sh

clean:
	rm -rf $(VENV)

# Two entry points, both usable on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs. On CPU machines torch is pinned
# to exactly 2.13.0 in the same pip call as everything else (constraints file), so no package
# can pull another torch.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
REQS    := requirements/base.txt requirements/constraints-cpu.txt pyproject.toml

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): $(REQS)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	ldconfig -p | grep -q libibverbs.so.1 || apt-get install -y -q libibverbs1 || \
		echo "libibverbs1 missing: Mooncake (segcache --remote-url) will not load"
	$(VPY) -m pip install -q -r requirements/base.txt -c requirements/constraints-cpu.txt
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VPY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m bench.demo

test: $(STAMP)
	$(VPY) -m pytest -q tests

clean:
	rm -rf $(VENV)

# Two entry points, both usable on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs. On CPU machines torch is pinned
# to exactly 2.13.0 in the same pip call as everything else (constraints file), so no package
# can pull another torch.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
REQS    := requirements/base.txt requirements/constraints-cpu.txt pyproject.toml
# fla's Triton kernels under the Triton interpreter (tests/kernels/test_fla_interpreter.py): a venv of
# its own, since fla must never be installed in .venv (see requirements/fla-interpreter.txt)
FLA_VENV  ?= .venv-fla
FLA_STAMP := $(FLA_VENV)/.installed
FLA_REQS  := requirements/fla-interpreter.txt requirements/constraints-cpu.txt

.PHONY: demo test test-fast venv fla-venv gpu-check gpu-wheels clean mutate compose-check

venv: $(STAMP)

$(STAMP): $(REQS)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	ldconfig -p | grep -q libibverbs.so.1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; } || \
		echo "libibverbs1 missing: Mooncake (segcache --remote-url) will not load"
	$(VPY) -m pip install -q -r requirements/base.txt -c requirements/constraints-cpu.txt
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VPY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

$(FLA_STAMP): $(FLA_REQS)
	test -x $(FLA_VENV)/bin/python || $(PY) -m venv $(FLA_VENV)
	$(FLA_VENV)/bin/python -m pip install -q -r requirements/fla-interpreter.txt -c requirements/constraints-cpu.txt
	$(FLA_VENV)/bin/python -c "import torch, fla; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(FLA_STAMP)

fla-venv: $(FLA_STAMP)

demo: $(STAMP)
	$(VPY) -m bench.demo

# The fla venv is built when it can be; when it cannot, its test skips and says why.
test: $(STAMP)
	-$(MAKE) --no-print-directory fla-venv
	$(VPY) -m pytest -q tests

# The quick loop while changing one module: every test that starts no OS process and is not slow
# (markers in pyproject.toml); under 3 minutes on 2 cores. `make test` (CI) still runs everything.
test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not processes and not slow" tests

# On a machine with NVIDIA GPUs and no network (docs/gpu.md): installs the wheels of .gpu-wheels/
# (`make gpu-wheels`, run here beforehand) into .gpu-site/ beside the machine's own torch, prints
# one table and gpu-check.json. `python scripts/gpu_check.py --dry-run` shows the rows without a GPU.
gpu-check:
	$(PY) scripts/gpu_check.py --json gpu-check.json

# The pinned cp312 manylinux x86_64 wheels of requirements/gpu-wheels.txt, for a GPU machine without
# network (they travel with the working tree: 64 MiB in all, measured about 19 MiB; nixl's CUDA
# build, 56-66 MiB alone, does not fit).
GPU_WHEELS := .gpu-wheels
gpu-wheels:
	$$(test -x $(VPY) && echo $(VPY) || echo $(PY)) -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEELS) -r requirements/gpu-wheels.txt
	du -sh $(GPU_WHEELS)
	test $$(du -sm $(GPU_WHEELS) | cut -f1) -le 64 || { echo "$(GPU_WHEELS) is over 64 MiB"; exit 1; }

# The mesh for real under Docker, CPU only (not part of test): scripts/compose-check.sh.
compose-check: $(STAMP)
	bash scripts/compose-check.sh

clean:
	rm -rf $(VENV) $(FLA_VENV) .venv-gpu .gpu-wheels .gpu-site

# Targeted mutation check (minutes; not part of `make test`): each mutant of a property that
# matters must make the tests that cover it fail. scripts/mutant_table.py lists them, scripts/mutate.py runs them.
mutate: $(STAMP)
	$(VPY) scripts/mutate.py

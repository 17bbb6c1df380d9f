# eagleflow: two commands do everything. `make demo` runs the embedded default, `make test` the suite.
# Both build the environments they need first (idempotent: a stamp file records the lock's hash).
SHELL := /bin/bash
PYTHON ?= python3
# Where this kind of machine keeps the CPU torch wheel (pip's find-links; uv does not read pip's config).
WHEELS ?= /opt/wheels
VENV := .venv
SGVENV := .venv-sglang
UV := $(VENV)/bin/uv
UVFLAGS := --find-links $(WHEELS) -c requirements/constraints.txt
CORES ?= 2
# Packages that pip's resolver would pull in but that break the CPU torch (their PyPI builds fail to import against it).
BROKEN := torchvision torchaudio torchcodec

.PHONY: demo test venv sglang-venv vllm-gpu-src lint lock report clean-venv remote-setup remote-profile remote-check device-lock device-bundle config-docs

venv: $(VENV)/.stamp
$(VENV)/.stamp: requirements/lock.txt requirements/data.txt requirements/constraints.txt pyproject.toml
	@echo "== building $(VENV) (main environment)"
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@test -x $(UV) || $(VENV)/bin/python -m pip install -q uv==0.13.9
	$(UV) pip install --python $(VENV)/bin/python $(UVFLAGS) --no-deps -r requirements/lock.txt
	$(UV) pip install --python $(VENV)/bin/python $(UVFLAGS) --no-deps -r requirements/data.txt
	$(UV) pip install --python $(VENV)/bin/python --no-deps -e .
	-@$(UV) pip uninstall --python $(VENV)/bin/python $(BROKEN) 2>/dev/null
	$(VENV)/bin/python -c "import torch, transformers, speculators, vllm, snakemake, datasets; print('torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
	@touch $@

sglang-venv: $(SGVENV)/.stamp
$(SGVENV)/.stamp: requirements/sglang-contract.txt requirements/constraints.txt tests/contract/torchvision_stub/torchvision/__init__.py
	@echo "== building $(SGVENV) (SGLang's code, for contract tests only)"
	@test -x $(VENV)/bin/python || $(MAKE) venv
	@test -x $(SGVENV)/bin/python || $(PYTHON) -m venv $(SGVENV)
	$(UV) pip install --python $(SGVENV)/bin/python $(UVFLAGS) -r requirements/sglang-contract.txt
	$(UV) pip install --python $(SGVENV)/bin/python --no-deps sglang==0.5.23
	-@$(UV) pip uninstall --python $(SGVENV)/bin/python $(BROKEN) 2>/dev/null
	@# torchvision cannot load beside the CPU torch; one import chain of sglang needs the module to exist.
	cp -r tests/contract/torchvision_stub/torchvision $$($(SGVENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/
	$(SGVENV)/bin/python -c "import sglang, sglang.srt.server_args; print('sglang', sglang.__version__)"
	@touch $@

# Regenerate the pins from pyproject.toml's ranges.
lock: venv
	$(UV) pip compile pyproject.toml --extra cpu --extra dev $(UVFLAGS) --python-version 3.11 \
	  $(foreach p,$(BROKEN) triton,--no-emit-package $(p)) --no-annotate --no-header -o requirements/lock.txt

# The offline bundle for a GPU host without internet (the lent GPU machine; `remote-setup
# BUNDLE=...`): the device lock's wheels that the host's image lacks, in parts of PART_MIB with a
# manifest (eagleflow.bundle). Downloads are cached in BUNDLE_CACHE.
BUNDLE ?= .device/bundle
BUNDLE_CACHE ?= .device/cache
PART_MIB ?= 56
device-lock: venv
	$(UV) pip compile requirements/device.in --python-version 3.12 \
	  --python-platform x86_64-manylinux_2_28 --no-annotate --no-header -o requirements/device-lock.txt

device-bundle: venv
	$(VENV)/bin/python src/eagleflow/bundle.py build --out $(BUNDLE) --cache $(BUNDLE_CACHE) --part-mib $(PART_MIB)

# config/README.md's key tables, rendered from workflow/schemas/config.schema.yaml (edit the schema).
config-docs: venv
	$(VENV)/bin/python -m eagleflow.config --write-docs config/README.md

lint: venv
	$(VENV)/bin/ruff check src tests workflow $(wildcard benchmarks)
	$(VENV)/bin/ruff format --check src tests workflow $(wildcard benchmarks)
	$(VENV)/bin/snakefmt --check Snakefile workflow/rules
	$(VENV)/bin/snakemake --lint --quiet 2>&1 | $(VENV)/bin/python tests/support/lint_filter.py

# The Python files of the GPU host's vLLM (the device lock's pin), for the flag contract test:
# its own server parser checks the commands eagleflow builds for that release (no CUDA needed).
VLLM_GPU_SRC := .device/vllm-src
vllm-gpu-src: $(VLLM_GPU_SRC)/.stamp
$(VLLM_GPU_SRC)/.stamp: requirements/device-lock.txt
	@echo "== unpacking the GPU host's vLLM ($$(grep '^vllm==' requirements/device-lock.txt)) for contract tests"
	$(VENV)/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 -d $(BUNDLE_CACHE)/lock \
	  $$(grep '^vllm==' requirements/device-lock.txt)
	rm -rf $(VLLM_GPU_SRC) && mkdir -p $(VLLM_GPU_SRC)
	$(VENV)/bin/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('vllm/') and n.endswith('.py')])" \
	  $$(ls $(BUNDLE_CACHE)/lock/vllm-$$(grep '^vllm==' requirements/device-lock.txt | cut -d= -f3)-*.whl) $(VLLM_GPU_SRC)
	@touch $@

test: venv sglang-venv vllm-gpu-src
	bash tests/support/system-deps.sh
	$(MAKE) lint
	bash tests/support/run_suite.sh $(VENV)/bin/python $(PYTEST_ARGS)

demo: venv
	@# gpu=1: GPU jobs (extraction, the standalone check, every benchmark) never share the machine
	$(VENV)/bin/snakemake --cores $(CORES) --resources gpu=1 --show-failed-logs $(SMK_ARGS)
	$(VENV)/bin/snakemake --report results/report.html
	@echo "report: $(CURDIR)/results/report.html"

# The GPU host of `snakemake --profile remote-gpu` (profiles/remote-gpu/README.md): link the profile
# into ~/.config/snakemake (Snakemake does not look in ./profiles for --profile), prepare the
# host's venv with the gpu-host extra, and report what it lacks.
remote-profile: venv
	$(VENV)/bin/eagleflow remote install-profile

# OFFLINE=1: a host that reaches no package index takes the offline bundle (make device-bundle).
remote-setup: venv $(if $(OFFLINE),device-bundle)
	$(VENV)/bin/eagleflow remote setup $(if $(OFFLINE),--bundle $(BUNDLE))

remote-check: venv
	$(VENV)/bin/eagleflow remote check

clean-venv:
	rm -rf $(VENV) $(SGVENV)

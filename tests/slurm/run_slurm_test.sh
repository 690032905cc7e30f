#!/usr/bin/env bash
# The SLURM test, end to end, on a Debian machine where we are root:
#   1. a two-node SLURM cluster on this host (setup_cluster.sh);
#   2. the executor plugin in an overlay directory, .slurm-site (`make slurm-site`, which says
#      why it cannot be an extra of the project's own environment);
#   3. pytest -m slurm with the overlay on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
tests/slurm/setup_cluster.sh
make slurm-site
.venv/bin/python -m pytest -m slurm -s "$@" tests/test_slurm.py

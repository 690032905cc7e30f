# shellcheck shell=bash
# On the GPU machine, from the repo root, after tools/gpu/install.sh: source tools/gpu/env.sh
# The carried wheels (/tmp/draftsmith_gpu/site) and the workflow on PYTHONPATH, a `python` for the
# rules' `python -m ...`, vLLM offline and without FlashInfer, results/ kept under
# /tmp/draftsmith_gpu (it outlives a call while the machine is warm; the repo's ignored folders
# may not) and the carried data wheels where `make real-data` expects them, so it only unpacks.

_dg_root=/tmp/draftsmith_gpu
if [[ ! -f $_dg_root/site/.installed ]]; then
    echo "env.sh: nothing installed in $_dg_root/site yet: tools/gpu/install.sh .gpu/parts/NN" >&2
fi

# `python` runs python3 by its own path: not a symlink, which would lose python3's venv
# (/opt/torch/.venv, with torch) since Python looks for pyvenv.cfg beside the path it was run by.
mkdir -p "$_dg_root/bin" "$_dg_root/results"
rm -f "$_dg_root/bin/python"
printf '#!/bin/sh\nexec %q "$@"\n' "$(command -v python3)" >"$_dg_root/bin/python"
chmod +x "$_dg_root/bin/python"

export PYTHONPATH="$_dg_root/site:$PWD/workflow"
case ":$PATH:" in
*":$_dg_root/bin:$_dg_root/site/bin:"*) ;;
*) export PATH="$_dg_root/bin:$_dg_root/site/bin:$PATH" ;;
esac
# FlashInfer is not carried: without this the engine fails at start.
export VLLM_USE_FLASHINFER_SAMPLER=0
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1

# results -> /tmp/draftsmith_gpu/results; a real results/ folder is moved there first.
if [[ ! -L results ]]; then
    if [[ -d results ]]; then
        cp -an results/. "$_dg_root/results/" && rm -rf results
    fi
    ln -s "$_dg_root/results" results
fi

# The data wheels, as if `make real-data` had downloaded them.
if compgen -G "$_dg_root/data/*.whl" >/dev/null && [[ ! -f results/real_data/wheels/.downloaded ]]; then
    mkdir -p results/real_data/wheels
    cp -l "$_dg_root"/data/*.whl results/real_data/wheels/ 2>/dev/null ||
        cp "$_dg_root"/data/*.whl results/real_data/wheels/
    touch results/real_data/wheels/.downloaded
fi
unset _dg_root

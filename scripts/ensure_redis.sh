#!/usr/bin/env bash
# Make a redis-server binary available for the test suite and benchmarks.
# Idempotent: does nothing when redis-server is already on PATH; otherwise installs Debian's
# redis-server package non-interactively (needs root or sudo and apt access).
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_redis: redis-server is not on PATH and apt-get is unavailable; install redis-server by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "ensure_redis: need root (or sudo) to install redis-server" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# The package's service is never used: the tests start their own server on a free port.
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null

if ! command -v redis-server >/dev/null 2>&1; then
    echo "ensure_redis: redis-server still not on PATH after installing the package" >&2
    exit 1
fi

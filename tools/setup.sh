#!/usr/bin/env bash
# Sets up a fresh machine for kvtier: Debian's redis-server and prometheus when missing (the
# remote-store tests run a real Redis, the Grafana board's test a real Prometheus), then kvtier itself, editable, with its dev extras at the tested versions of
# constraints.txt (torch==2.13.0 there takes the CPU build: pip prefers 2.13.0+cpu from the local
# wheel folder, and no range is left open for pip to reach a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null \
    || ! command -v prometheus >/dev/null; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server prometheus >/dev/null
fi
python3 -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"

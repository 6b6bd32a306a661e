#!/usr/bin/env bash
# Debian packages the tests need, installed once, quietly (idempotent): faketime runs a real
# collector with a stepped wall clock in tests/test_lifecycle_faketime.py.
set -euo pipefail
need=()
command -v faketime >/dev/null 2>&1 || need+=(faketime)
[[ ${#need[@]} -eq 0 ]] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-debs.sh: apt-get not found; install: ${need[*]}" >&2
    exit 2
fi
sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo -n)
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 \
    || { "${sudo[@]}" apt-get update -qq >/dev/null && "${sudo[@]}" apt-get install -y -qq "${need[@]}" >/dev/null; }

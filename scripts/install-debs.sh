#!/usr/bin/env bash
# Debian packages the tests need, installed once, quietly (idempotent): faketime runs a real
# collector with a stepped wall clock in tests/test_lifecycle_faketime.py; openssl makes the
# secured test broker's certificates (scripts/kafka-secure.sh); kcat is the plain, non-Python
# Kafka client of tests/test_billing_topic.py and the README's "Consuming the billing topic";
# Debian's chromium opens the HTML chargeback report headless in tests/test_report.py
# (fonts-dejavu-core: its text); util-linux's setpriv runs inspect without root's file-mode
# override in tests/test_inspect_cli.py.
set -euo pipefail
need=()
for tool in faketime openssl kcat; do
    command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
command -v chromium >/dev/null 2>&1 || need+=(chromium fonts-dejavu-core)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
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

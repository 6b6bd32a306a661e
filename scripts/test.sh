#!/usr/bin/env bash
# The whole test suite: installs the Debian tools the tests use, starts the real Kafka broker,
# then pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash scripts/install-debs.sh
bash scripts/kafka.sh start >/dev/null
# The operators' tools the tests run (built once, cached outside the checkout).
bash scripts/tools.sh all >/dev/null
exec .venv/bin/pytest -q -p no:cacheprovider "$@"

#!/usr/bin/env bash
# The whole test suite on CPU (gloo, multi-process). Sets up ./.venv on first use.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_env.sh")"
cd "$root"
# No arguments: the whole suite. Arguments: passed to pytest instead (e.g. a test path).
if [ "$#" -eq 0 ]; then set -- tests; fi
exec "$py" -m pytest -q "$@"

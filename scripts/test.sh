#!/usr/bin/env bash
# The whole test suite on CPU (gloo, multi-process). Sets up ./.venv on first use.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_env.sh")"
cd "$root"
# No arguments: the whole suite, on two pytest workers, each test file on one of them (pytest-xdist
# --dist loadfile: a file's module fixtures, e.g. one Megatron-LM release's training runs, stay in one process).
# Arguments: passed to pytest instead (e.g. a test path; one process, so -s prints).
if [ "$#" -eq 0 ]; then set -- -n 2 --dist loadfile tests; fi
exec "$py" -m pytest -q "$@"

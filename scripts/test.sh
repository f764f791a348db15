#!/usr/bin/env bash
# Set up (scripts/setup.sh --test), lint, and run every test of the core, plugins and examples.
# Fails when pytest collects no test at all.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
scripts/setup.sh --test
printf '\033[1m==> %s\033[0m\n' "ruff check"
"$VENV/bin/ruff" check .
paths=(tests)
for d in plugins/*/tests examples/*/tests; do [ -d "$d" ] && paths+=("$d"); done
printf '\033[1m==> %s\033[0m\n' "pytest ${paths[*]}"
set +e
"$VENV/bin/python" -m pytest -q "${paths[@]}" "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc

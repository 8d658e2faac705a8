#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh needs beside a GPU image's own packages, into .whl/ (gitignored):
# the GPU images lent here hold torch, transformers, msgpack and pytest but not llguidance, which
# engine/structured_output.py imports (and so every engine test). Run here, where pip reaches PyPI;
# then run the check there with .whl carried along, e.g. (the device tool)
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"])
# and gpu_check.sh installs them into /tmp/site first. PY_VERSION: the GPU image's Python (3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
version=$("$PY" -c "import importlib.metadata as m; print(m.version('llguidance'))")
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp "${platforms[@]}" -d .whl "llguidance==$version"
ls -l .whl

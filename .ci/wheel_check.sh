#!/usr/bin/env bash
# The package as a user gets it: build the wheel, install it (not editable) into a fresh virtual environment,
# then import weft's packages and run a tutorial through the installed `weft` command, from outside the checkout.
# VENV: the environment that builds (default .venv, the Makefile's); `build` is installed there if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY="${VENV:-.venv}/bin/python"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m build --version >/dev/null 2>&1 || "$PY" -m pip install -q build
"$PY" -m build --wheel --outdir "$TMP/dist" . >"$TMP/build.log" 2>&1 || { cat "$TMP/build.log"; exit 1; }
WHEEL=$(ls "$TMP"/dist/triton_weft-*.whl)
echo "wheel: $(basename "$WHEEL")"
# What the wheel must carry beside the modules: the type marker and the tuning tables.
"$PY" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["weft/py.typed", "weft/tuning/data/H200-x2.json", "weft/cli.py", "weft/kernels/registry.py"]
missing = [n for n in need if n not in names]
licenses = [n for n in names if n.endswith("/LICENSE")]
if missing or not licenses:
    sys.exit(f"the wheel lacks {missing or 'its LICENSE'}")
PY

python3 -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q "$WHEEL" "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
cd "$TMP"  # away from the checkout: only the installed package can be imported
"$TMP/venv/bin/python" -c "import weft; weft.models; weft.layers; weft.ops; print('import weft:', weft.__file__)"
case "$("$TMP/venv/bin/python" -c 'import weft; print(weft.__file__)')" in
  "$TMP"/venv/*) ;;
  *) echo "weft was not imported from the installed wheel"; exit 1 ;;
esac
"$TMP/venv/bin/weft" run -n 2 "$REPO/tutorials/02_all_gather.py"
echo "wheel check passed"

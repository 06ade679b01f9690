#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel, install the wheel (not editable) into a fresh
# virtual environment, then import weft's packages and run a tutorial through the installed `weft` command, from
# outside the checkout.
# VENV: the environment that builds (default .venv, the Makefile's); `build` is installed there if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY="${VENV:-.venv}/bin/python"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m build --version >/dev/null 2>&1 || "$PY" -m pip install -q build
# The sdist, then the wheel built from it in an isolated directory: what the sdist lacks, the wheel lacks too,
# and no build/ left in the checkout can put stale modules into the wheel.
"$PY" -m build --outdir "$TMP/dist" . >"$TMP/build.log" 2>&1 || { cat "$TMP/build.log"; exit 1; }
WHEEL=$(ls "$TMP"/dist/triton_weft-*.whl)
echo "wheel: $(basename "$WHEEL")"
# Every file of the source package (modules, py.typed, the tuning tables) is in the wheel, and the LICENSE.
"$PY" - "$WHEEL" <<'PY'
import pathlib, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
source = {p.as_posix() for p in pathlib.Path("weft").rglob("*")
          if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
missing = sorted(source - names) + ([] if any(n.endswith("/licenses/LICENSE") for n in names) else ["LICENSE"])
if missing:
    sys.exit(f"the wheel lacks {', '.join(missing)}")
print(f"the wheel holds all {len(source)} files of weft/ and the LICENSE")
PY

python3 -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q "$WHEEL" "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
cd "$TMP"  # away from the checkout: only the installed package can be imported
# The ops, layers and models need none of the extras (matplotlib, rich, transformers, safetensors).
"$TMP/venv/bin/python" -c "import importlib.util as u, sys; sys.exit([m for m in ('matplotlib', 'rich', 'transformers',
'safetensors') if u.find_spec(m)] or 0)"
"$TMP/venv/bin/python" -c "import weft; weft.models; weft.layers; weft.ops; print('import weft:', weft.__file__)"
case "$("$TMP/venv/bin/python" -c 'import weft; print(weft.__file__)')" in
  "$TMP"/venv/*) ;;
  *) echo "weft was not imported from the installed wheel"; exit 1 ;;
esac
"$TMP/venv/bin/weft" run -n 2 "$REPO/tutorials/02_all_gather.py"
echo "wheel check passed"

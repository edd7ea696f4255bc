#!/usr/bin/env bash
# Create .venv-nemo: NVIDIA's nemo-automodel (unedited) on the CPU torch, plus a link to our package.
#
#   bash tests/nemo/parity/setup_venv.sh [VENV_DIR]
#
# Environment (set by `make test-nemo` from the Makefile): PYTHON, TORCH_SPEC, TORCH_INDEX,
# NEMO_AUTOMODEL_VERSION. Our own .venv is never touched: NeMo pins transformers==5.18 and
# that pin must stay in this venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="${1:-$ROOT/.venv-nemo}"
[[ "$VENV" = /* ]] || VENV="$PWD/$VENV"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
TORCH_INDEX="${TORCH_INDEX:-}"
NEMO="${NEMO_AUTOMODEL_VERSION:-0.7.0}"
STAMP="$VENV/.installed-nemo-automodel-$NEMO"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

# Our package's pure dependencies needed at run time by dspark_cache.nemo / the loader.
OUR_DEPS=(msgspec xxhash webdataset safetensors numpy psutil zstandard)
# What importing and running train_dspark and precompute_dspark needs on CPU (measured: these
# imports and the whole harness pass with exactly this list): used with `--no-deps` when the full
# resolve fails, or first when NEMO_MINIMAL=1 (1.5 GB instead of ~3 GB, no CUDA/triton wheels).
NEMO_CPU_DEPS=("transformers==5.18.0" pyyaml datasets torchao torchdata pillow)

check() {
  "$PY" - <<'EOF'
import importlib
for name in ("nemo_automodel.recipes.llm.train_dspark",
             "nemo_automodel.components.speculative.precompute_dspark"):
    importlib.import_module(name)
import transformers
print(f"nemo venv ok: transformers {transformers.__version__}")
try:  # our side may be mid-change; run.py reports what it needs as pending or crash
    import dspark_cache.nemo  # noqa: F401
except Exception as exc:
    print(f"note: dspark_cache.nemo does not import here yet ({type(exc).__name__}: {exc})")
EOF
}

if [[ -f "$STAMP" ]]; then
  # A venv made before a dependency was added (zstandard: compressed caches) gets it, once.
  "$PY" -c "import zstandard" 2>/dev/null || "${PIP[@]}" "${OUR_DEPS[@]}" "$TORCH_SPEC"
  exit 0
fi

start=$(date +%s)
echo "creating $VENV (nemo-automodel==$NEMO on $TORCH_SPEC; first run only, a few minutes)"
[[ -x "$PY" ]] || "$PYTHON" -m venv "$VENV"
"$PY" -c "import torch" 2>/dev/null || "${PIP[@]}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH_SPEC"
minimal() {
  "${PIP[@]}" --no-deps "nemo-automodel==$NEMO"
  "${PIP[@]}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "${NEMO_CPU_DEPS[@]}" "$TORCH_SPEC"
}
if [[ "${NEMO_MINIMAL:-0}" = 1 ]]; then
  minimal
elif ! "${PIP[@]}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "nemo-automodel==$NEMO" "$TORCH_SPEC"; then
  echo "full resolve of nemo-automodel==$NEMO failed; installing it with --no-deps and an explicit CPU list"
  minimal
fi
# triton comes in through flashoptim; the triton it resolves (3.9) rejects the autotune key of
# nemo_automodel/components/_peft/lora_kernel.py at import time ("key contains names that are
# not kernel arguments: S"), which breaks importing every NeMo recipe. Without triton NeMo
# falls back to its CPU stubs (HAVE_TRITON=False). Nothing here needs triton on CPU.
"$PY" -m pip uninstall -y -q triton 2>/dev/null || true
"${PIP[@]}" "${OUR_DEPS[@]}" "$TORCH_SPEC"

# Our package, importable without installing it (and without building anything in the repo):
# a folder holding a symlink to dspark_cache/, added to sys.path by a .pth file.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$VENV/dspark-link"
ln -sfn "$ROOT/dspark_cache" "$VENV/dspark-link/dspark_cache"
echo "$VENV/dspark-link" > "$SITE/dspark_cache_link.pth"

check
echo "$(($(date +%s) - start)) s" > "$STAMP"
echo "nemo venv ready in $(cat "$STAMP")"

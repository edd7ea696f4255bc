#!/usr/bin/env bash
# Create .venv-nemo: NVIDIA's nemo-automodel (unedited) on the CPU torch, plus a link to our package.
#
#   bash tests/nemo_parity/setup_venv.sh [VENV_DIR]
#
# Environment (set by `make test-nemo` from the Makefile): PYTHON, TORCH_SPEC, TORCH_INDEX,
# NEMO_AUTOMODEL_VERSION. Our own .venv is never touched: NeMo pins transformers==5.18 and
# that pin must stay in this venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-nemo}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
TORCH_INDEX="${TORCH_INDEX:-}"
NEMO="${NEMO_AUTOMODEL_VERSION:-0.7.0}"
STAMP="$VENV/.installed-nemo-automodel-$NEMO"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

# Our package's pure dependencies needed at run time by dspark_cache.nemo / the loader.
OUR_DEPS=(msgspec xxhash webdataset safetensors numpy psutil)
# Fallback when the full resolve of nemo-automodel fails (e.g. a CUDA-only dependency has no
# wheel here): what importing and running train_dspark and precompute_dspark needs on CPU.
NEMO_CPU_DEPS=(
  "transformers==5.18.0" datasets pyyaml torchdata torchao megatron-fsdp==0.5.0 "mistral-common[hf-hub,sentencepiece]"
  tiktoken ninja flashoptim
)

check() {
  "$PY" - <<'EOF'
import importlib
for name in ("nemo_automodel.recipes.llm.train_dspark",
             "nemo_automodel.components.speculative.precompute_dspark",
             "dspark_cache.nemo"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if name == "dspark_cache.nemo" and exc.name and exc.name.startswith("dspark_cache"):
            continue  # not written yet: run.py reports the modes that need it as pending
        raise
import transformers
print(f"nemo venv ok: transformers {transformers.__version__}")
EOF
}

if [[ -f "$STAMP" ]]; then
  exit 0
fi

start=$(date +%s)
echo "creating $VENV (nemo-automodel==$NEMO on $TORCH_SPEC; first run only, a few minutes)"
[[ -x "$PY" ]] || "$PYTHON" -m venv "$VENV"
"$PY" -c "import torch" 2>/dev/null || "${PIP[@]}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH_SPEC"
if ! "${PIP[@]}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "nemo-automodel==$NEMO" "$TORCH_SPEC"; then
  echo "full resolve of nemo-automodel==$NEMO failed; installing it with --no-deps and an explicit CPU list"
  "${PIP[@]}" --no-deps "nemo-automodel==$NEMO"
  "${PIP[@]}" "${NEMO_CPU_DEPS[@]}" "$TORCH_SPEC"
fi
# triton comes in through flashoptim; triton>=3.5 rejects the autotune key of
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

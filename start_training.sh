#!/usr/bin/env bash
# The one command: set up (idempotent), prepare the embedded default (SmolLM2-135M-Instruct + ShareGPT),
# warm up, train, checkpoint, summarise.   bash start_training.sh [train_dflash.py options...]
# With no options it runs the embedded default: on CPU sized to finish in about 10 minutes, on GPUs
# the DFlash recipe on every visible GPU. Options override those defaults. Output also goes to logs/.
# On GPUs the embedded default first has the target write answers of its own (generate_data.py, once: the result
# is cached), then trains on those and ShareGPT's with the target's own next-token distribution as the loss
# (--distill 1.0); DFLASH_REGENERATE=0 trains on ShareGPT's answers alone.
# Run again, it continues from the newest checkpoint (--resume; a finished run has nothing to do).
# DFLASH_SKIP_INSTALL=1 skips the package checks (tests); PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# no library progress bars in the log (transformers' GGUF reader draws its own whatever transformers is told)
export TQDM_DISABLE=1
own_data=0
[[ " $* " == *" --target "* && " $* " == *" --data "* ]] && own_data=1
cache=.cache     # the embedded default and its regenerated answers: train_dflash.py's --cache-dir, where given
args=("$@")
for i in "${!args[@]}"; do
  case ${args[$i]} in --cache-dir) cache=${args[$((i + 1))]:-$cache} ;; --cache-dir=*) cache=${args[$i]#*=} ;; esac
done
if [ "${DFLASH_SKIP_INSTALL:-0}" != 1 ]; then
  # what is missing (an installed torch is kept); the data packages unless --target and --data are given
  $PY install.py $([ "$own_data" = 1 ] || echo --data)
fi
mkdir -p logs
log="logs/train_$(date +%Y%m%d_%H%M%S).log"
echo "[start] logging to $log"
if $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  # distillation from the target beats its hard labels at equal training time (BENCHMARKS.md)
  # a training time, not a number of epochs: a first start takes a known time (BENCHMARKS.md)
  defaults=(--out-dir out/default --resume --distill 1.0 --max-minutes 15 --log-interval 100 --tensorboard auto)
  if [[ " $* " != *" --target "* ]]; then
    # the embedded default's small drafter: blocks of 8 (at its acceptance a round almost never gets past draft
    # position 7) on twice the anchors, batches of 4 sequences for more steps, and the loss's weight falling faster
    # over the block (gamma 2, not 4: most rounds end at the first draft positions): higher acceptance in the same
    # time (BENCHMARKS.md); a large target keeps the DFlash recipe's block 16, its gamma and its automatic batch.
    # The budget, not the 8 epochs, ends the run on one H200 (the schedule follows it)
    defaults+=(--block-size 8 --num-anchors 1024 --tokens-per-batch 12288 --gamma 2 --epochs 8)
    if [[ " $* " != *" --data "* && "${DFLASH_REGENERATE:-1}" = 1 ]]; then
      # the target's own answers next to ShareGPT's: higher acceptance in the same training time, the regeneration
      # included in the run's time (BENCHMARKS.md). Sampled answers loop less than greedy ones; 512 new
      # tokens cover what acceptance is measured on, and an answer cut there ends its conversation, untaught an end
      # of turn the target did not write. ShareGPT last: its last conversations stay the held-out ones, their
      # copies never trained on.
      regen=$cache/sharegpt_v3_sampled.jsonl     # a second start reuses it
      if ! $PY -u generate_data.py --out "$regen" --cache-dir "$cache" --temperature 0.8 --max-new-tokens 512 \
           --unfinished cut 2>&1 | tee "$log"; then
        echo "[start] generate_data.py failed (see $log); DFLASH_REGENERATE=0 trains on ShareGPT's answers alone"
        exit 1
      fi
      defaults+=(--data "$regen" "$cache/sharegpt_v3.jsonl")
    fi
  fi
else
  echo "[start] CPU: training on ShareGPT's own answers (the target rewriting them needs a GPU to be quick)"
  # CPU: a short sequence length, fewer anchors and samples, an 8-minute training budget
  # (plus ~1-2 min of setup): the loss visibly falls; the recipe needs GPUs.
  defaults=(--out-dir out/cpu_default --max-length 256 --num-anchors 32 --max-samples 4000
            --max-minutes 8 --log-interval 10 --ckpt-interval 200 --lr 1e-3 --resume --tensorboard auto)
fi
set +e
# Ctrl-C or SIGTERM (`timeout` signals the whole group): the trainer checkpoints its step and stops; this script
# waits for it (a trap, which its children do not inherit) and tee, ignoring them, still writes its last lines
trap ':' TERM
$PY -u train_dflash.py "${defaults[@]}" "$@" 2>&1 | (trap '' INT TERM; exec tee -a "$log")
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ]; then
  # the main job measures what it made: the command the trainer printed last, on its held-out conversations
  # (on a CPU eval_dflash.py's short defaults), its figures into <out-dir>/eval.json and the drafter's card
  cmd=$(grep -a -o 'python eval_dflash.py --target .*' "$log" | tail -n 1 || true)
  if [[ -z "$cmd" || "$cmd" == *YOUR_PROMPTS* ]]; then
    echo "[start] acceptance not measured: the run holds out no conversations (--heldout 0, or synthetic data)" \
      | tee -a "$log"
  else
    read -r -a eval_args <<< "${cmd#python }"
    drafter=${cmd#* --drafter }
    drafter=${drafter%% *}
    echo "[start] measuring the drafter: ${cmd} --json $(dirname "$(dirname "$drafter")")/eval.json" | tee -a "$log"
    $PY -u "${eval_args[@]}" --json "$(dirname "$(dirname "$drafter")")/eval.json" 2>&1 \
      | (trap '' INT TERM; exec tee -a "$log")
    rc=${PIPESTATUS[0]}
  fi
fi
exit "$rc"

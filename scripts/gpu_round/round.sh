#!/usr/bin/env bash
# Draft training on a lent GPU machine, run from the repository root (scripts/gpu_round/README.md).
#
# Three distillations share the one GPU, started together so that each one's host work (batching, top-k,
# Python) overlaps the others' kernels:
#   ind   the independent draft continued from the committed default on more distinct oracle replies
#   featA a feature draft converted from the default (fc = [0 | I]), fc's learning rate by the measured rule
#   featB the same with --fc-lr-scale 0.2
# then one eval-draft --device cuda compares all of them with the default on the same oracle replies.
# What comes back under $OUT: reports.tgz (eval JSON, metrics, logs), and the independent draft and the better
# feature draft as tar files cut into 15 MB pieces (the device returns at most 8 files of 16 MiB).
#
# SMOKE=1 runs the same commands on the CPU at toy scale (tests/test_gpu_round.py): it checks the
# commands, not the drafts.  DRYRUN=1 only writes the full-scale commands to $ROUND_DIR/commands.
set -uo pipefail

SMOKE=${SMOKE:-0}
DEVICE=${DEVICE:-cuda}
R=${ROUND_DIR:-/tmp/r13}
OUT=${OUT:-$R/out}
TRAIN_MINUTES=${TRAIN_MINUTES:-13}   # each training loop's time box; the schedule is sized to end inside it
mkdir -p "$R" "$OUT"
export PYTHONUNBUFFERED=1

if [ "$SMOKE" = 1 ]; then
  # toy scale: a few steps on short windows, a dozen replies, 2 prompts in eval-draft
  IND_TOKENS=2048; FEAT_TOKENS=2048; SEQ=64; BATCH=2; SAMPLES=6; SBATCH=4; EVERY=2
  EVAL="--n-prompts 2 --tokens 8 --accept-prompts 1 --accept-tokens 8"; EXTRA="--threads 1 --no-progress"
  CORPUS="--corpus $(python3 -c 'import json, pathlib; print(pathlib.Path(json.__file__))')"
  PKGS=""
else
  # sized for one H100 shared three ways (alone: 25-30 k tokens/s independent, 22-25 k feature; docs/draft.md)
  IND_TOKENS=${IND_TOKENS:-8000000}; FEAT_TOKENS=${FEAT_TOKENS:-5000000}; SEQ=512; BATCH=32
  SAMPLES=${SAMPLES:-12000}; SBATCH=256; EVERY=50
  EVAL=""; EXTRA=""; CORPUS=""  # progress on: its per-evaluation lines go to the logs
  # request sources beyond the stdlib: installed packages' documented functions (never HumanEval)
  PKG_PATHS=$(python3 - <<'EOF'
import importlib.util
names = ["numpy", "scipy", "sympy", "networkx", "pandas", "sklearn", "matplotlib", "statsmodels"]
print(" ".join(s.submodule_search_locations[0] for n in names
               if (s := importlib.util.find_spec(n)) and s.submodule_search_locations))
EOF
)
  PKGS=${PKG_PATHS:+--sample-from $PKG_PATHS}
fi

stagedspec() {  # DRYRUN=1: write the commands to $R/commands instead of running them (tests/test_gpu_round.py)
  if [ "${DRYRUN:-0}" = 1 ]; then echo "stagedspec $*" >> "$R/commands"; else python3 -m stagedspec "$@"; fi
}

run() {  # run NAME ARGS...: one distillation, its log in $R/NAME.log
  local name=$1; shift
  stagedspec distill --device "$DEVICE" --oracle default --out "$R/$name" --work-dir "$R/$name-work" \
    --seq-len $SEQ --batch-size $BATCH --min-lr-ratio 0.05 --chat-wrap 0.6 --sample-tokens 160 --sample-repeat 2 \
    --sample-batch $SBATCH --eval-every $EVERY --checkpoint-every $EVERY --max-minutes "$TRAIN_MINUTES" \
    $CORPUS $EXTRA "$@" > "$R/$name.log" 2>&1
  echo "$name exit $?" >> "$R/status"
}

: > "$R/status"
# One set of oracle replies for all three runs: sampled once (one training step), then each run reads a copy.
# The replies draft v6 was trained on (CPU bf16, seed 6) seed the cache: requests built here that match them are not sampled again.
zcat data/distill/smollm2-135m-replies-seed6.jsonl.gz > "$R/replies.jsonl"
COMMON=(--oracle-samples $SAMPLES $PKGS --seed 9)
run presample --init-from default --layers 2 --tokens $IND_TOKENS --lr 3e-4 "${COMMON[@]}" \
  --samples-cache "$R/replies.jsonl" --stop-after-steps 1
for d in ind featA featB; do mkdir -p "$R/$d-work" && cp "$R/replies.jsonl" "$R/$d-work/replies.jsonl"; done

run ind --init-from default --layers 2 --tokens $IND_TOKENS --lr 3e-4 "${COMMON[@]}" \
  --samples-cache "$R/ind-work/replies.jsonl" &
FEAT=(--kind feature --init-from default --ttt-steps 3 --feature-loss 0 --tokens $FEAT_TOKENS --lr 1e-4 "${COMMON[@]}")
run featA "${FEAT[@]}" --samples-cache "$R/featA-work/replies.jsonl" &
run featB "${FEAT[@]}" --samples-cache "$R/featB-work/replies.jsonl" --fc-lr-scale 0.2 &
wait
cat "$R/status"

# Side by side on the same oracle replies (20 HumanEval prompts unless SMOKE).
drafts=default
for d in ind featA featB; do [ -f "$R/$d/draft.safetensors" ] || [ "${DRYRUN:-0}" = 1 ] && drafts="$drafts,$R/$d"; done
stagedspec eval-draft --device "$DEVICE" --oracle default --draft "$drafts" $EVAL --json \
  > "$R/eval-draft.json" 2> "$R/eval-draft.log"
echo "eval-draft exit $?" >> "$R/status"

# The better feature draft by its last held-out KL (the eval JSON has the HumanEval figures for both).
best=$(python3 - "$R" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
def last_kl(name):
    try:
        return json.loads((root / f"{name}-work" / "metrics.json").read_text())[-1]["heldout_kl"]
    except (OSError, ValueError, LookupError, TypeError):
        return float("inf")
print(min(["featA", "featB"], key=last_kl))
EOF
)
echo "better feature draft: $best" >> "$R/status"

tar czf "$OUT/reports.tgz" -C "$R" status eval-draft.json eval-draft.log ind.log presample.log featA.log featB.log \
  $(cd "$R" && ls -d ind-work/metrics.json featA-work/metrics.json featB-work/metrics.json 2>/dev/null)
for d in ind "$best"; do
  if [ -f "$R/$d/draft.safetensors" ]; then
    tar cf "$R/$d.tar" -C "$R" "$d" && split -b 15000000 -d "$R/$d.tar" "$OUT/$d.tar."
  fi
done
ls -la "$OUT"

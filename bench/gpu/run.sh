#!/usr/bin/env bash
# The GPU runs, as one re-runnable command for the device machine (no network there).
#
#   bench/gpu/prepare.sh                        # here, once: the pinned wheels into .whl/
#   bench/gpu/run.sh                            # on the device: the training-speed steps, JSON into $OUT
#   bench/gpu/run.sh dds sft                    # only these steps (model/pairs are made when missing)
#   bench/gpu/run.sh all                        # every step (more than one 10-minute device call holds)
#   bench/gpu/run.sh plant                      # the organism's profile planted into the 7B-shaped model (a call of its own)
#   bench/gpu/run.sh --dry-run                  # here, no CUDA: install the wheels into a temp target and
#                                               # import every module the GPU steps use (tests/test_gpu_dry_run.py)
#   bench/gpu/run.sh --shape tiny               # here, on CPU: every step at hidden 64, 2 layers (4-bit NF4 too:
#                                               # bitsandbytes 0.50 has a CPU backend; --no-4bit loads the base in full)
#
# Steps (each under its own `timeout`, a failed one recorded and passed). Training at 7B shape (the default call,
# bench/training_speed.md): sft, dpo, kto (recipes/qwen7b.yaml as shipped: the 24GB memory profile, prefix sharing),
# sft_80gb, dpo_80gb, kto_80gb (--memory_budget 80GB), sft_asis, dpo_asis (the recipe's own batch, TRL's padded
# rows: c90e646's path). Then: dds (the DDS pass, prefix sharing on and off), env matmul builds model pairs merge,
# organism_cuda organism (a later call), sft_fast (SFT without recompute, batch 16 x 1), plant (`flipguard organism
# --base` on the 7B-shaped model with --device cuda: what a LoRA step and a held-out check cost at 7B; the random-init
# model cannot pass its checks, so the end is the one-line failure and the result is the costs). builds: the organism CPU builds in the
# background (bench/gpu/organism_builds.sh; their table and the seed-0 builds come back as organism_build_robustness.*
# and organisms.tar.gz). Results: $OUT/gpu.json (all steps: rc, seconds, result or the error's last lines, the peak GPU
# memory nvidia-smi saw), $OUT/gpu.log (everything printed), $OUT/organism_comparison.md (the study's table).
# flipguard runs from this checkout without an install: its folder is linked as `flipguard` on PYTHONPATH and
# plugins.py reads pyproject.toml's entry points (no pip metadata there).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SHAPE=7b
QUANT=1
DRY=0
STEPS=()
# the call as typed, with the settings it read from the environment (recorded in each step's record)
CALL=""
for v in RUN_BUDGET_S BUDGET_SCALE TRAIN_STEPS DDS_BATCHES DDS_JUDGMENTS MERGE_GAP_PROMPTS PLANT_STEPS PLANT_CHECK_ITEMS CUDA_SEEDS; do
  [[ -n "${!v:-}" ]] && CALL+="$v=${!v} "
done
CALL+="bench/gpu/run.sh $*"
while (($#)); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --shape) SHAPE="$2"; shift ;;
    --no-4bit) QUANT=0 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    all) STEPS+=(env matmul model pairs sft dpo kto sft_80gb dpo_80gb kto_80gb sft_asis dpo_asis dds merge
                 builds organism_cuda organism plant) ;;
    env|matmul|builds|model|pairs|dds|sft|sft_fast|dpo|kto|sft_80gb|dpo_80gb|kto_80gb|sft_asis|dpo_asis|merge|organism_cuda|organism|plant)
      STEPS+=("$1") ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
# one 10-minute device call holds the 7B-shaped steps and the CPU builds; the organism's GPU steps are a second
# call (`bench/gpu/run.sh organism_cuda organism`)
((${#STEPS[@]})) || STEPS=(env model pairs sft_80gb dpo_80gb sft dpo kto_80gb kto)

# accelerate (and the study's `accelerate launch`) from the same environment as $PY
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
export PATH OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1 ACCELERATE_DISABLE_RICH=1

# ------------------------------------------------------------------ wheels and flipguard on the path
SITE="${FG_SITE:-}"
if [[ -z "$SITE" ]]; then
  if ((DRY)); then
    TMP_SITE="$(mktemp -d)"; SITE="$TMP_SITE/site"; trap 'rm -rf "$TMP_SITE"' EXIT
  else
    SITE=/tmp/site
  fi
fi
install_wheels() {
  compgen -G "$ROOT/.whl/*.whl" >/dev/null || { echo "run.sh: no wheels in $ROOT/.whl: run bench/gpu/prepare.sh first" >&2; return 1; }
  local cross=()
  # the wheels are the device's (CPython 3.12, x86-64 Linux); another Python (a CI machine's) installs them as
  # they are, as the device would (multiprocess ships one wheel per Python version)
  "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' ||
    cross=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform any)
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    "${cross[@]}" --target "$SITE" "$ROOT"/.whl/*.whl
}
install_wheels || exit 1
SRC="$(dirname "$SITE")/src"
mkdir -p "$SRC"
ln -sfn "$ROOT" "$SRC/flipguard"
export PYTHONPATH="$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}"

if ((DRY)); then
  # every module the GPU steps import, from the carried wheels, and flipguard's entry points from pyproject
  "$PY" - "$SITE" <<'EOF'
import importlib, sys, warnings
site = sys.argv[1]
warnings.simplefilter("ignore")
mods = ["trl", "datasets", "dill", "multiprocess", "peft", "bitsandbytes", "accelerate", "transformers",
        "trl.trainer.sft_trainer", "trl.trainer.dpo_trainer",
        "flipguard.train.sft", "flipguard.train.dpo", "flipguard.train.merge", "flipguard.train.utils",
        "flipguard.eval.backends.hf", "flipguard.pipeline.cli", "flipguard.pipeline.organism"]
from_site = ["trl", "datasets", "dill", "multiprocess", "peft", "bitsandbytes"]
for name in mods:
    m = importlib.import_module(name)
    where = getattr(m, "__file__", "") or ""
    if name in from_site and not where.startswith(site):
        sys.exit(f"dry run: {name} came from {where}, not from the wheels in {site}")
    print(f"ok {name} {getattr(m, '__version__', '')} {where}")
import importlib.util
spec = importlib.util.spec_from_file_location("qwen7b", "bench/gpu/qwen7b.py")
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("ok bench/gpu/qwen7b.py")
from flipguard import plugins
for group in (plugins.TASKS, plugins.BACKENDS, plugins.MODELS):
    print("ok entry points", group, sorted(plugins.plugins(group)))
print("dry run: all imports ok")
EOF
  exit $?
fi

# ------------------------------------------------------------------ the run
OUT="${OUT:-$ROOT/runs/gpu_out}"
mkdir -p "$OUT"
if [[ -z "${WORK:-}" ]]; then
  shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
  if [[ "$SHAPE" == 7b && "${shm_free:-0}" -gt $((48 * 1024 * 1024)) ]]; then WORK=/dev/shm/fg; else WORK=/tmp/fg; fi
fi
R="$WORK/results"
mkdir -p "$R" "$WORK"
MODEL="$WORK/model_$SHAPE"
PAIRS="$WORK/pairs_$SHAPE"
LOG="$OUT/gpu.log"
export FLIPGUARD_HOME="${FLIPGUARD_HOME:-$WORK/fg_home}"
DEADLINE=$(($(date +%s) + ${RUN_BUDGET_S:-570}))
HAVE_GPU=0
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && HAVE_GPU=1
exec > >(tee -a "$LOG") 2>&1
echo "run.sh: steps ${STEPS[*]} shape $SHAPE 4bit $QUANT work $WORK out $OUT gpu $HAVE_GPU $(date -u +%FT%TZ)"

# per-step budgets in seconds, times BUDGET_SCALE (a loaded CPU); a step gets at most what is left before RUN_BUDGET_S
declare -A BUDGET=([env]=60 [matmul]=60 [builds]=20 [model]=150 [pairs]=60 [dds]=200 [sft]=110 [sft_fast]=150 [dpo]=110
                   [kto]=110 [sft_80gb]=110 [dpo_80gb]=110 [kto_80gb]=110 [sft_asis]=150 [dpo_asis]=150 [merge]=200
                   [organism_cuda]=150 [organism]=240 [plant]=400)
TRAIN=(--model_name_or_path "$MODEL" --pairs_dir "$PAIRS" --report_to none --save_strategy no --logging_steps 1
       --max_steps "${TRAIN_STEPS:-6}" --num_train_epochs 1)
LAUNCH=(accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no)
if ((HAVE_GPU)); then
  LAUNCH+=(--config_file recipes/accelerate_configs/single_gpu.yaml)
else  # CPU check: no CUDA autocast (fp16 needs a GPU), fp32 weights
  LAUNCH+=(--cpu)
  TRAIN+=(--use_cpu true --bf16 false --fp16 false --dtype float32)
fi
((QUANT)) || TRAIN+=(--load_in_4bit false)

step_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" - "$R/env.json" <<'EOF'
import json, subprocess, sys, importlib, platform
out = {"python": platform.python_version()}
for name in ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "datasets", "pyarrow",
             "fsspec", "huggingface_hub", "safetensors", "tokenizers"):
    try:
        m = importlib.import_module(name)
        out[name] = getattr(m, "__version__", "?")
    except Exception as exc:
        out[name] = f"import failed: {type(exc).__name__}: {exc}"
import torch
out["cuda"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    out["device"] = torch.cuda.get_device_name(0)
    out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
    out["nvidia_smi"] = smi
except Exception as exc:
    out["nvidia_smi"] = f"unavailable: {exc}"
try:
    import bitsandbytes as bnb
    out["bitsandbytes_lib"] = str(getattr(bnb.cextension, "BNB_BACKEND", "")) + " " + str(getattr(getattr(bnb.cextension, "lib", None), "_name", ""))
except Exception as exc:
    out["bitsandbytes_lib"] = f"{type(exc).__name__}: {exc}"
json.dump(out, open(sys.argv[1], "w"), indent=2)
print(json.dumps(out, indent=2))
EOF
}
step_matmul() { "$PY" bench/gpu/qwen7b.py matmul --json "$R/matmul.json"; }
step_model() { rm -rf "$MODEL"; "$PY" bench/gpu/qwen7b.py model --shape "$SHAPE" --out "$MODEL" --json "$R/model.json"; }
step_pairs() { rm -rf "$PAIRS"; "$PY" bench/gpu/qwen7b.py pairs --tokenizer "$MODEL" --out "$PAIRS" --rows 128 --json "$R/pairs.json"; }
step_dds() {
  local peak
  peak=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['tflops'])" "$R/matmul.json" 2>/dev/null || echo "")
  "$PY" bench/gpu/qwen7b.py dds --model "$MODEL" --batch_sizes "${DDS_BATCHES:-32,128}" --sharing on,off \
    --judgments "${DDS_JUDGMENTS:-512}" ${peak:+--peak_tflops "$peak"} --json "$R/dds.json"
}
train_step() {  # sft | dpo [result name] [more trainer flags]
  local kind=$1 name=${2:-$1}
  rm -rf "$WORK/$name"
  "${LAUNCH[@]}" "train/$kind.py" recipes/qwen7b.yaml "${TRAIN[@]}" "${@:3}" --output_dir "$WORK/$name" &&
    "$PY" bench/gpu/qwen7b.py train-stats --kind "$kind" --adapter "$WORK/$name" --pairs "$PAIRS" \
      --pairs_json "$R/pairs.json" --json "$R/$name.json"
}
step_sft() { train_step sft; }
# the memory profiles: the recipe's 24GB (as shipped) and an 80 GB card's; KTO has no section in the recipe, so
# its batch and learning rate are DPO's (4 x 4, 5e-5) and its dtype the recipe's bf16
KTO=(--per_device_train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 5e-5 --bf16 true)
step_sft_80gb() { train_step sft sft_80gb --memory_budget 80GB; }
step_dpo_80gb() { train_step dpo dpo_80gb --memory_budget 80GB; }
step_kto() { train_step kto kto "${KTO[@]}"; }
step_kto_80gb() { train_step kto kto_80gb "${KTO[@]}" --memory_budget 80GB; }
# the recipe as it was (c90e646): its own batch and checkpointing, TRL's padded rows
step_sft_asis() { train_step sft sft_asis --memory_budget none --prefix_sharing false; }
step_dpo_asis() { train_step dpo dpo_asis --memory_budget none --prefix_sharing false; }
# the SFT throughput question (4.18 samples/s against a target of 25): the recipe's effective batch 16 as
# one micro-batch without activation recompute, the cost gradient checkpointing and 4 x 4 accumulation pay for
# the recipe's memory figure (not the recipe: bench/gpu.md says which figure is which)
step_sft_fast() { train_step sft sft_fast --gradient_checkpointing false --per_device_train_batch_size 16 \
  --gradient_accumulation_steps 1; }
step_dpo() { train_step dpo; }
step_merge() {
  rm -rf "$WORK/merged"
  local t0=$SECONDS
  "$PY" train/merge.py recipes/qwen7b.yaml --adapter "$WORK/sft" --out "$WORK/merged" --model_name_or_path "$MODEL" \
    --pairs_dir "$PAIRS" --gap_prompts "$MERGE_GAP_PROMPTS" "${MERGE_ARGS[@]}" || return $?
  "$PY" - "$WORK/merged/flipguard_merge.json" "$R/merge.json" $((SECONDS - t0)) <<'EOF'
import json, sys
info = json.load(open(sys.argv[1]))
info["wall_s_with_gap_check"] = int(sys.argv[3])
json.dump(info, open(sys.argv[2], "w"), indent=2, default=str)
print(json.dumps(info, indent=2, default=str))
EOF
}
# the merge-gap check loads the merged model and the 4-bit base + adapter again: on the 7B shape about as long
# as the merge itself, so off there unless asked for (MERGE_GAP_PROMPTS=8)
if [[ "$SHAPE" == 7b ]]; then MERGE_GAP_PROMPTS="${MERGE_GAP_PROMPTS:-0}"; else MERGE_GAP_PROMPTS="${MERGE_GAP_PROMPTS:-8}"; fi
MERGE_ARGS=()
((QUANT)) || MERGE_ARGS+=(--load_in_4bit false)
((HAVE_GPU)) || MERGE_ARGS+=(--dtype float32)
# the organism CPU builds (bench/organism_build_robustness.py) run in the background on the CPU cores
# while the GPU steps run; builds_finish waits for them and brings back their table and the seed-0 builds
step_builds() { bash bench/gpu/organism_builds.sh start; }
# the organism built on the GPU (--device cuda), its seeds side by side (CUDA_SEEDS)
step_organism_cuda() { bash bench/gpu/organism_builds.sh cuda; }
step_organism() {
  rm -rf "$WORK/organism_gpu"
  local model=()  # the CUDA-built seed 0 when there is one (this checkout may have no shipped organism yet)
  [[ -f "$WORK/cuda_s0/organism.json" ]] && model=(--model "$WORK/cuda_s0")
  "$PY" -m flipguard study recipes/organism_gpu.yaml --out "$WORK/organism_gpu" "${model[@]}" || return $?
  cp "$WORK/organism_gpu/comparison.md" "$OUT/organism_comparison.md"
  "$PY" - "$WORK/organism_gpu" "$R/organism.json" <<'EOF'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
out = {"out": str(run), "files": sorted(p.name for p in run.iterdir())}
for name in ("comparison.json", "study.json"):
    if (run / name).is_file():
        out[name] = json.loads((run / name).read_text())
json.dump(out, open(sys.argv[2], "w"), indent=2, default=str)
EOF
}

# the organism's profile planted into the model of the shape (flipguard organism --base): LoRA in bf16 on the GPU
# (CPU: fp32), one phase of PLANT_STEPS steps with a held-out check at its end; no capability cost (lm-eval is not
# among the device's wheels); plant-stats reads the costs off its log (a random-init model fails its checks: the
# expected end)
step_plant() {
  rm -rf "$WORK/planted"
  local device=cpu dtype=float32 rc
  ((HAVE_GPU)) && device=cuda dtype=bfloat16
  "$PY" -m flipguard organism --base "$MODEL" --device "$device" --dtype "$dtype" --steps "${PLANT_STEPS:-20}" \
    --eval_every "${PLANT_STEPS:-20}" --check_items "${PLANT_CHECK_ITEMS:-50}" --quick_check_items "${PLANT_CHECK_ITEMS:-50}" \
    --no_capability --out "$WORK/planted" >"$WORK/plant.out" 2>&1
  rc=$?
  cat "$WORK/plant.out"
  "$PY" bench/gpu/qwen7b.py plant-stats --log "$WORK/plant.out" --rc "$rc" --organism "$WORK/planted" --json "$R/plant.json"
}

aggregate() {  # every step's record into $OUT/gpu.json (rewritten after each step: a timeout keeps the rest)
  "$PY" - "$R" "$OUT/gpu.json" "$SHAPE" "$QUANT" <<'EOF'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
out = {"shape": sys.argv[3], "load_in_4bit": sys.argv[4] == "1", "calls": [], "steps": {}}
for meta in sorted(r.glob("*.step.json")):
    name = meta.name.removesuffix(".step.json")
    rec = json.loads(meta.read_text())
    res = r / f"{name}.json"
    if res.is_file():
        rec["result"] = json.loads(res.read_text())
    out["steps"][name] = rec
    if rec.get("call") and rec["call"] not in out["calls"]:  # each call that made a step here, as it was typed
        out["calls"].append(rec["call"])
env = out["steps"].get("env", {}).get("result", {})
out["device"] = env.get("nvidia_smi") or env.get("device") or "cpu"
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=2, default=str) + "\n")
EOF
}

run_step() {
  local name=$1 left=$((DEADLINE - $(date +%s))) budget=$((${BUDGET[$1]} * ${BUDGET_SCALE:-1})) rc t0 smi_pid=""
  ((budget > left - 5)) && budget=$((left - 5))
  if ((budget < 10)); then
    printf '{"rc": null, "skipped": "out of time (RUN_BUDGET_S)"}\n' >"$R/$name.step.json"; aggregate; return
  fi
  echo "=== step $name (budget ${budget}s) $(date -u +%T)"
  rm -f "$R/$name.json" "$WORK/$name.smi"
  if ((HAVE_GPU)); then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 >"$WORK/$name.smi" 2>/dev/null &
    smi_pid=$!
  fi
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$budget" bash -c "$(declare -p LAUNCH TRAIN MERGE_ARGS KTO); $(declare -f step_$name train_step); step_$name" \
    >"$WORK/$name.log" 2>&1
  rc=$?
  cat "$WORK/$name.log"
  [[ -n "$smi_pid" ]] && kill "$smi_pid" 2>/dev/null
  "$PY" - "$R/$name.step.json" "$rc" "$t0" "$budget" "$WORK/$name.log" "$WORK/$name.smi" "$CALL" <<'EOF'
import json, pathlib, sys, time
path, rc, t0, budget, log, smi, call = sys.argv[1:8]
rec = {"rc": int(rc), "seconds": round(time.time() - float(t0), 1), "budget_s": int(budget), "call": call}
if int(rc) == 124 or int(rc) == 137:
    rec["error"] = f"timed out after {budget} s"
if int(rc) != 0:
    text = pathlib.Path(log).read_text(errors="replace")
    rec["error_tail"] = text[-3000:]
s = pathlib.Path(smi)
if s.is_file():
    used = [int(x) for x in s.read_text().split() if x.strip().isdigit()]
    if used:
        rec["nvidia_smi_peak_mib"] = max(used)
pathlib.Path(path).write_text(json.dumps(rec, indent=2) + "\n")
EOF
  aggregate
  echo "=== step $name rc $rc"
}

export PY ROOT WORK R MODEL PAIRS OUT SHAPE QUANT HAVE_GPU MERGE_GAP_PROMPTS
for s in "${STEPS[@]}"; do
  # the later steps need the model and pairs: made first when a rerun names only later steps
  case "$s" in
    dds|sft*|dpo*|kto*|merge|plant) [[ -f "$MODEL/config.json" ]] || run_step model ;;
  esac
  case "$s" in
    sft*|dpo*|kto*|merge) [[ -d "$PAIRS/sft" ]] || run_step pairs ;;
  esac
  run_step "$s"
done
# the CPU builds' table and the seed-0 builds, whatever time is left (their bench stops itself at its deadline)
[[ -f "$WORK/builds/pid" ]] && bash bench/gpu/organism_builds.sh finish
echo "run.sh: done $(date -u +%FT%TZ); $OUT/gpu.json"

#!/usr/bin/env bash
# The organism builds of issues 31 and 34 on the device machine, beside bench/gpu/run.sh's GPU steps:
#
#   bench/gpu/organism_builds.sh start    # CPU builds in the background: bench/organism_build_robustness.py,
#                                         # seeds 0-9 at 1 thread + 3 strengths, one core each (BUILD_JOBS)
#   bench/gpu/organism_builds.sh cuda     # the same defaults built on the GPU (--device cuda), seeds 0-2
#   bench/gpu/organism_builds.sh finish   # wait for the CPU builds; their table, organism.json's and the
#                                         # seed-0 builds (CPU and CUDA) into $OUT
#
# Run with run.sh's environment (PY, WORK, OUT, PYTHONPATH with flipguard on it).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-python3}"
B="$WORK/builds"
mkdir -p "$B"
case "${1:-}" in
  start)
    # shellcheck disable=SC2086  (word lists)
    nohup "$PY" bench/organism_build_robustness.py --seeds ${BUILD_SEEDS:-0 1 2 3 4 5 6 7 8 9} --threads 1 \
      --strengths ${BUILD_STRENGTHS-0.2 0.6 0.8} --build_args "${BUILD_ARGS:-}" --jobs "${BUILD_JOBS:-13}" --deadline "${BUILD_DEADLINE_S:-520}" --work "$B" \
      --out "$B/organism_build_robustness" >"$B/bench.log" 2>&1 &
    echo $! >"$B/pid"
    echo "organism builds started (pid $(cat "$B/pid"), ${BUILD_JOBS:-13} at a time, deadline ${BUILD_DEADLINE_S:-520} s)"
    ;;
  cuda)
    for seed in ${CUDA_SEEDS:-0}; do  # side by side on the one GPU
      "$PY" -m flipguard.pipeline.cli organism --device cuda --force --path "$WORK/cuda_s$seed" --seed "$seed" \
        --threads 1 >"$WORK/cuda_s$seed.log" 2>&1 &
    done
    wait
    tail -n 12 "$WORK"/cuda_s*.log
    "$PY" - "$WORK" "$R/organism_cuda.json" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
out = {}
for d in sorted(p for p in work.glob("cuda_s*") if p.is_dir()):  # not the builds' logs
    f = d / "organism.json"
    out[d.name] = json.loads(f.read_text()) if f.is_file() else "failed (no organism.json)"
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps({k: (v if isinstance(v, str) else {"seconds": v["build_seconds"], "steps": v["steps_trained"],
                   "test": v["measured_test_logprob"], "conv": v["measured_conversations_test"]}) for k, v in out.items()},
                 indent=1))
EOF
    ;;
  finish)
    pid=$(cat "$B/pid" 2>/dev/null || echo "")
    [[ -n "$pid" ]] && while kill -0 "$pid" 2>/dev/null; do sleep 2; done
    tail -40 "$B/bench.log"
    cp "$B/organism_build_robustness.md" "$B/organism_build_robustness.json" "$OUT/" 2>/dev/null
    # every build's log tail and the seed-0 builds' folders (the shipped organism is one of them)
    tar czf "$OUT/organisms.tar.gz" -C "$WORK" $(cd "$WORK" && ls -d builds/s0-t1 builds/s1-t1 builds/*.log cuda_s* 2>/dev/null)
    ls -la "$OUT"
    ;;
  *) echo "usage: $0 start|cuda|finish" >&2; exit 2 ;;
esac

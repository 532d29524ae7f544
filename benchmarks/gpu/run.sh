#!/usr/bin/env bash
# The GPU check: everything this project knows how to verify and measure on a CUDA GPU, in one command that ends
# within a budget (default 330 s), each part time-boxed so that one failure never hides the rest.
#
#   bash benchmarks/gpu/run.sh          on a CUDA machine (the device tool: carry .whl from fetch_wheels.sh)
#   bash benchmarks/gpu/run.sh --cpu    the same steps on a CPU with qwen2-tiny (CI runs this: the script never rots)
#
# Parts (MRL_GPU_PARTS, default "install,env,tests,compare"):
#   install  the carried wheels in .whl/ (TRL and what the image lacks) into /tmp/site, without network
#   env      versions, nvidia-smi, cores and memory
#   tests    pytest -m cuda (tests/test_cuda.py; skipped without CUDA, collected all the same)
#   compare  mrl compare on benchmarks/gpu/compare_gpu.yaml (qwen2-360m, bf16): vanilla TRL against the plugin,
#            interleaved repeats, GPU utilization and memory sampled by nvidia-smi
# then benchmarks/gpu/summarize.py writes summary.json and summary.md (steps/s ratio, time to a reward level, GPU
# memory per process, weight-sync ms per version, GPU busy share, the tests' outcomes).
#
# Results go to $OUT (the device tool sets it; default ./gpu-check-out): run.log, summary.json, summary.md,
# cuda_tests.log, report.md and results.tar.gz (everything else: run logs, report.json, plots, nvidia-smi samples).
#
# Knobs: MRL_GPU_BUDGET_S (whole script, default 330), MRL_GPU_RUNS (run kinds, default upstream,all),
# MRL_GPU_REPEATS (default 2), MRL_GPU_STEPS (default: the config's), MRL_GPU_TESTS_S (tests' box, default 150),
# MRL_GPU_REWARD_LEVEL (time-to-reward threshold, default 0.9), MRL_GPU_PYTEST (extra pytest arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then
    MODE=cpu
elif [ -n "${1:-}" ]; then
    echo "usage: bash benchmarks/gpu/run.sh [--cpu]" >&2
    exit 2
fi
OUT="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUT"
WORK="$OUT/work"
rm -rf "$WORK"
mkdir -p "$WORK"
exec > >(tee "$OUT/run.log") 2>&1

BUDGET=${MRL_GPU_BUDGET_S:-330}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
PARTS=${MRL_GPU_PARTS:-install,env,tests,compare}
has_part() { [[ ",$PARTS," == *",$1,"* ]]; }
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
STATUS="$WORK/parts.jsonl"
: > "$STATUS"
part_done() {  # name, exit code, seconds
    printf '{"part": "%s", "rc": %s, "seconds": %s}\n' "$1" "$2" "$3" >> "$STATUS"
    echo "=== part $1: exit $2 after $3 s ($(left) s of the budget left)"
}
echo "=== GPU check, mode $MODE, parts $PARTS, budget $BUDGET s, $(date -u +%Y-%m-%dT%H:%M:%SZ)"

if [ "$MODE" = gpu ] && has_part install; then
    t0=$(date +%s)
    rc=0
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            > "$WORK/install.log" 2>&1 || rc=$?
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no .whl/ here: nothing installed (bash benchmarks/gpu/fetch_wheels.sh, then carry .whl)"
    fi
    $PY -c "import trl, datasets, crc32c; print('trl', trl.__version__, 'datasets', datasets.__version__)" || rc=$?
    part_done install $rc $(($(date +%s) - t0))
fi

if has_part env; then
    t0=$(date +%s)
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "cores: $(nproc)"
        free -g 2>/dev/null | head -2
        nvidia-smi 2>&1 || echo "no nvidia-smi"
    } > "$WORK/env.txt" 2>&1
    $PY - > "$WORK/env.json" <<'EOF'
import datetime, importlib.metadata as md, json, platform, sys
out = {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "python": sys.version.split()[0],
       "platform": platform.platform()}
for name in ("torch", "transformers", "trl", "accelerate", "datasets", "peft", "pyarrow", "safetensors", "crc32c"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
import torch
out["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
               capability=".".join(map(str, torch.cuda.get_device_capability(0))), gpus=torch.cuda.device_count())
print(json.dumps(out))
EOF
    rc=$?
    cat "$WORK/env.json"
    head -20 "$WORK/env.txt"
    part_done env $rc $(($(date +%s) - t0))
fi

if has_part tests; then
    t0=$(date +%s)
    box=${MRL_GPU_TESTS_S:-150}
    [ "$box" -gt "$(($(left) - 30))" ] && box=$(($(left) - 30))
    rc=0
    # the image's packages differ from CI's pins: their deprecation notices must not fail a CUDA test
    # shellcheck disable=SC2086
    timeout -k 10 "$box" $PY -m pytest -m cuda tests/test_cuda.py -v -rs -p no:cacheprovider \
        -W ignore::DeprecationWarning -W ignore::FutureWarning --junitxml="$WORK/cuda_tests.xml" \
        ${MRL_GPU_PYTEST:-} > "$OUT/cuda_tests.log" 2>&1 || rc=$?
    tail -25 "$OUT/cuda_tests.log"
    part_done tests $rc $(($(date +%s) - t0))
fi

if has_part compare; then
    t0=$(date +%s)
    runs=${MRL_GPU_RUNS:-upstream,all}
    repeats=${MRL_GPU_REPEATS:-2}
    args=(--config benchmarks/gpu/compare_gpu.yaml --runs "$runs" --repeats "$repeats" --out "$WORK/compare")
    if [ "$MODE" = cpu ]; then
        args+=(--model qwen2-tiny --steps "${MRL_GPU_STEPS:-6}")
    elif [ -n "${MRL_GPU_STEPS:-}" ]; then
        args+=(--steps "$MRL_GPU_STEPS")
    fi
    box=$(($(left) - 25))
    per_run=$((box / 2))
    [ "$per_run" -lt 60 ] && per_run=60
    rc=0
    if [ "$box" -lt 30 ]; then
        echo "compare: only $box s left of the budget: not started"
        rc=124
    else
        timeout -k 15 "$box" $PY -m mrl_plugins.cli.main compare "${args[@]}" --timeout "$per_run" || rc=$?
    fi
    part_done compare $rc $(($(date +%s) - t0))
fi

$PY benchmarks/gpu/summarize.py "$OUT" --mode "$MODE" --level "${MRL_GPU_REWARD_LEVEL:-0.9}"
summary_rc=$?
[ -f "$WORK/compare/report.md" ] && cp "$WORK/compare/report.md" "$OUT/report.md"
tar -C "$OUT" -czf "$OUT/results.tar.gz" work
rm -rf "$WORK"
echo "=== GPU check done in $(($(date +%s) - START)) s; results in $OUT"
exit $summary_rc

#!/usr/bin/env bash
# Every speed benchmark on a GPU machine, prepared to fit a short lease (issue 25, item 6: 1k, 10k, 100k and
# 1M clients). Two modes:
#
#   bash benchmarks/on_gpu.sh wheels
#       Here, on a machine with pip and PyPI: downloads into .whl/ the pure-Python packages fedbayes needs that a
#       GPU image with JAX (CUDA), NumPyro, xarray, pandas and SciPy usually lacks (the ArviZ 1.x line, for its
#       Python 3.12). List .whl/ in .git/info/exclude and send it with the working tree.
#
#   bash benchmarks/on_gpu.sh run OUT [STEP ...]
#       There: installs .whl/ into a private folder (where ArviZ is missing), then runs the steps in order, each
#       in a fresh process under its own time limit, each table written to OUT/<step>.md line by line as it prints
#       (a step that runs out of time leaves the rows it finished) and its errors to OUT/<step>.err (where
#       bench_fedsoul.py also notes each column of a row as it ends). Steps (default: all, in this order; the
#       never-measured 1M-client FedSOUL row first):
#         fedsoul1m  bench_fedsoul.py at 1 000 000 clients, every client each round      (limit 210 s)
#         fedsoul    bench_fedsoul.py at 1 000, 10 000 and 100 000 clients                (limit 120 s)
#         startup    bench_startup.py (1 000 clients, the first and second call's phases) (limit 60 s)
#         langevin   bench_langevin.py --throughput at 1 000, 10 000, 100 000, best of 1 (limit 180 s)
#         fedmm      bench_fedmm.py --nproc 0 at 1 000, 10 000 and 100 000 clients        (limit 120 s)
#       The sizes can be changed with FEDSOUL_SIZES, LANGEVIN_SIZES and FEDMM_SIZES, the limits with
#       <STEP>_LIMIT (e.g. FEDSOUL1M_LIMIT=300), the interpreter with PYTHON (default python3). OUT/machine.txt
#       gets the GPU, the driver and the versions.
#
# The whole default run is at most 11.5 minutes, which with a machine's start fits a lease of 15: split it over
# two commands of at most 10 minutes, `run $OUT fedsoul1m fedsoul startup` (6.5) and `run $OUT langevin fedmm`
# (5). Nothing here assumes a GPU: with PYTHON=.venv/bin/python and small sizes it runs on a CPU too
# (benchmarks/README.md, "On a GPU").
set -u
cd "$(dirname "$0")/.."

mode=${1:-}
case "$mode" in
wheels)
    mkdir -p .whl
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl arviz arviz-base arviz-stats arviz-plots xarray-einstats
    ls .whl
    exit 0
    ;;
run) ;;
*)
    echo "usage: bash benchmarks/on_gpu.sh wheels | run OUT [fedsoul1m fedsoul startup langevin fedmm ...]" >&2
    exit 2
    ;;
esac

out=${2:?"run needs OUT, the folder the tables go to"}
shift 2
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(fedsoul1m fedsoul startup langevin fedmm)
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import arviz" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then  # only what is missing
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedbayes-site \
        .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/fedbayes-site"
fi
{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$py" -c 'import os, platform, jax, numpyro, fedbayes
print("Python", platform.python_version(), "| jax", jax.__version__, "|", jax.devices(), "| numpyro",
      numpyro.__version__, "| cores", os.cpu_count())'
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

step() {  # name, default limit, command...
    local name=$1 limit_var limit
    limit_var=$(echo "$1" | tr '[:lower:]' '[:upper:]')_LIMIT
    limit=${!limit_var:-$2}
    shift 2
    echo "== $name: $* (limit ${limit} s), from $(date -u +%T)"
    timeout -k 5 "$limit" "$py" "$@" >"$out/$name.md" 2>"$out/$name.err"
    echo "   exit $? at $(date -u +%T)"
}

for s in "${steps[@]}"; do
    case "$s" in
    fedsoul1m) step fedsoul1m 210 benchmarks/bench_fedsoul.py --clients 1000000 --fractions 1.0 ;;
    fedsoul) step fedsoul 120 benchmarks/bench_fedsoul.py --clients ${FEDSOUL_SIZES:-1000 10000 100000} \
        --fractions 1.0 ;;
    langevin) step langevin 180 benchmarks/bench_langevin.py --throughput --repeats 1 \
        --clients ${LANGEVIN_SIZES:-1000 10000 100000} ;;
    fedmm) step fedmm 120 benchmarks/bench_fedmm.py --nproc 0 --clients ${FEDMM_SIZES:-1000 10000 100000} ;;
    startup) step startup 60 benchmarks/bench_startup.py ;;
    *) echo "unknown step $s" >&2 ;;
    esac
done

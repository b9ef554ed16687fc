#!/usr/bin/env bash
# On a GPU machine of the device tool, in one call: the figures of BENCHMARKS.md "Training loop goodput
# on a GPU". Here first: bash bench/device_wheels.sh. Then the call:
#   run(command="bash bench/device_goodput.sh", carry=[".whl"], timeout_s=600)
# Arguments replace the 1B preset's (a CPU rehearsal: bash bench/device_goodput.sh --preset tiny --cpu).
# The bench keeps its JSON after every run, in priority order (long and short intervals first), so a run
# cut off by the time limit still brings back what finished; the tables are printed from that JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    echo "cores $(nproc), $(free -g | awk '/Mem:/ {print $2}') GiB; $(df -h /tmp | tail -1)"
    python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || echo "C kernels not built: numpy casts" | tee -a "$OUT/machine.txt"
python3 -c "import stagerd.cmd.watch, stagerd.training" || exit 1
# On CUDA, where stream order guarantees them: the forward-updated buffers (BatchNorm) saved as at
# save(), and the paced side-stream copy exact and ordered after the step queued before save().
if python3 -c "import pytest" 2> /dev/null; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider -p no:xdist -o addopts="" \
        tests/training/test_forward_buffers.py tests/training/test_host_copy.py -k cuda 2>&1 | tail -3 \
        | tee "$OUT/cuda-tests.log"
fi
if [ $# -eq 0 ]; then
    set -- --preset 1b --long 18 --short 4 --saves 8 --slow-saves 2 --base-steps 24 --adjacent-steps 24
fi
timeout 470 python3 bench/bench_goodput.py "$@" --json "$OUT/goodput.json" > "$OUT/goodput.log" 2>&1
echo "bench exit $?"
grep -v "^\s*$" "$OUT/goodput.log" | tail -5
[ -s "$OUT/goodput.json" ] && python3 bench/bench_goodput.py --report "$OUT/goodput.json"
# Last, in what time is left: how long the loop's own `.item()` waits behind a save's copy, queued whole
# against paced (measured in earlier runs; BENCHMARKS.md).
timeout 60 python3 bench/bench_copy_pacing.py --json "$OUT/pacing.json" 2>&1 | tee "$OUT/pacing.log"

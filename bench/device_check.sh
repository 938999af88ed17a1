#!/usr/bin/env bash
# The CUDA path in one go, for a lent GPU machine (the `device` tool: 15 minutes of device time a
# task, 10 a command, a bare machine with torch and pytest but not zinf). From the repo's root:
#
#     bash bench/device_check.sh            # writes into $OUT (the tool's), else ./device-out
#
# 1. installs this checkout (no dependencies fetched: the machine has torch, sympy, networkx,
#    matplotlib, transformers and accelerate); 2. tests/test_cuda.py (side-stream offload, CPU and
#    NVMe shards gathered onto the GPU, streamed inference, tiles; each against Inductor and under
#    the budget by torch.cuda.max_memory_allocated); 3. `bench training` and 4. `bench inference`
#    on the GPU, one repeat each, sized to fit what is left. Each step has its own time limit, so
#    one that hangs costs only its share; the log and the benchmarks' JSON and PNG come back.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/log.txt"
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
step environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  df -h "${TMPDIR:-/tmp}" | tail -1; } 2>&1 | tee -a "$LOG"
step install
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || { echo "install failed" | tee -a "$LOG"; exit 1; }
step "tests/test_cuda.py"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -40 | tee -a "$LOG"
step "bench training (GPU)"
timeout 180 python3 -m bench training --device cuda --repeats 1 --steps 3 --out "$OUT" 2>&1 | tail -15 | tee -a "$LOG"
step "bench inference (GPU)"
timeout 180 python3 -m bench inference --device cuda --repeats 1 --layers 8 --out "$OUT" 2>&1 | tail -15 | tee -a "$LOG"
step done

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
#    on the GPU, one repeat each (training: the 8-layer GPT; inference: 4 layers of the Llama). Each step has its own time limit (together under the
#    tool's 600 s a command: run it with timeout_s=600), so one that hangs costs only its share; the
#    log and the benchmarks' JSON and PNG come back. A bench exits 1 when one of its checks fails:
#    its JSON says which.
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
timeout 150 python3 -m pytest -q -rP -p no:cacheprovider --timeout=90 tests/test_cuda.py >"$OUT/pytest.txt" 2>&1
grep -E '\[cuda\]|passed|failed|Error|assert' "$OUT/pytest.txt" | tail -60 | tee -a "$LOG"  # the whole output: pytest.txt
step "bench training (GPU)"
timeout 200 python3 -m bench training --device cuda --repeats 1 --contenders resident,zinf-cpu,zinf-nvme --threads 8 --out "$OUT" 2>&1 | tail -15 | tee -a "$LOG"
step "bench inference (GPU)"
timeout 170 python3 -m bench inference --device cuda --repeats 1 --layers 4 --forwards 2 --threads 8 --contenders eager,inductor,zinf,accelerate --out "$OUT" 2>&1 | tail -15 | tee -a "$LOG"
step done

#!/bin/bash
# The whole GPU gate (tools/gpu_gate.py) as one job across device calls: started under
# setsid from the repository root on the device machine (the device tool's run), its
# parts in order, each part's log and JSON in /tmp/gate; a part whose JSON exists is not
# run again (resumable if the machine is the same). Follow it with
#     bash tools/device_jobs/wait.sh 540 gate
# each call within 30 s of the last (the gate took three 10-minute calls on an H100,
# 2026-12-07, `--workers 16`). The last line of each part is its `gpu gate: N/N`.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=/tmp/gate; mkdir -p $D
nvidia-smi --query-gpu=name,memory.total --format=csv > $D/card.txt 2>&1
# name, --only pattern and --big-T of each part: every small case once (the default's block
# cases first: what a GPU's plan chooses is what CI cannot run), then the benchmark shape
PARTS=("block_rest|block(?!.*by (partials|atomics))|0" "block_sums|block.*by (partials|atomics)|0"
       "nonblock|^(?!.*block)|0" "bench|bench|131072")
for part in "${PARTS[@]}"; do
  IFS='|' read -r name only big <<< "$part"
  [ -f $D/$name.json ] && continue
  echo "$name start $(date +%s)" >> $D/stages
  python tools/gpu_gate.py --workers 16 --big-T $big --only "$only" --json $D/$name.json > $D/$name.log 2>&1
  echo "$name rc=$? $(date +%s)" >> $D/stages
done
echo done >> $D/stages

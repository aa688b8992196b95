#!/bin/bash
# A device allotment's job, started under setsid from the repository root on the device
# machine (the device tool's run), its logs in /tmp/g; follow it with wait.sh (each call
# within 30 s of the last). Stages in the order they pay (issues 103, 104): the backward's
# launch account (python -m benchmarks.profile --pass account) and the whole model's step,
# each at the shorter length first, the gate's default block cases where asked, seed 0 of
# the extension study (resumable by stage; the base's bfloat16 pieces for a
# later allotment, the longest stage last).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=/tmp/g; mkdir -p $D
COMMIT=${COMMIT:-unknown}
STAGES=${STAGES:-account train seed}   # a subset runs only those, in this order
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $D/card.txt 2>&1
python -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" > $D/env.txt 2>&1
# The launch account and the whole model's step each at the shorter length first, so that
# an allotment cut short still brings back a figure of each.
for size in 131072 524288; do
  if has account; then
    echo "account $size start $(date +%s)" >> $D/stages
    python -m benchmarks.profile --pass account --shapes 32/4,32/8 --sizes $size --iters 3 \
        --json $D/account_$size.json > $D/account_$size.log 2>&1
    echo "account $size rc=$? $(date +%s)" >> $D/stages
  fi
  if has train; then
    tsize=$(( size / 2 ))   # the step at 64K, then 128K (the two lengths)
    [ $size = 524288 ] && tsize=131072
    echo "train $tsize start $(date +%s)" >> $D/stages
    python benchmarks/bench_train_step.py --models frontier,g4 --sizes $tsize --inputs random,text --iters 3 \
        --json $D/train_step_$tsize.json --commit $COMMIT > $D/train_$tsize.log 2>&1
    echo "train $tsize rc=$? $(date +%s)" >> $D/stages
  fi
done
if has gate; then   # the default's block cases of the gate (gate.sh's first part)
python tools/gpu_gate.py --workers 16 --big-T 0 --only 'block(?!.*by (partials|atomics))' \
    --json $D/gate_block.json > $D/gate_block.log 2>&1
echo "gate rc=$? $(date +%s)" >> $D/stages
fi
if has seed; then
python benchmarks/extension_seed.py --dir $D/seed0 --seed 0 --pieces $D/pieces0 --progress-every 200 \
    --variants dense,block:512,block:256,query:512 > $D/seed.log 2>&1
echo "seed rc=$? $(date +%s)" >> $D/stages
fi
echo done >> $D/stages

#!/bin/bash
# A device allotment's job, started under setsid from the repository root on the device
# machine (the device tool's run), its logs in /tmp/g; follow it with wait.sh (each call
# within 30 s of the last). Stages in the order they pay (issues 103, 104): the backward's
# launch account (python -m benchmarks.profile --pass account), the whole model's step,
# seed 0 of the extension study (resumable by stage; the base's bfloat16 pieces for a
# later allotment, the longest stage last).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=/tmp/g; mkdir -p $D
COMMIT=${COMMIT:-unknown}
STAGES=${STAGES:-account train seed}   # a subset runs only those, in this order
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $D/card.txt 2>&1
python -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" > $D/env.txt 2>&1
if has account; then
echo "account start $(date +%s)" >> $D/stages
python -m benchmarks.profile --pass account --shapes 32/4,32/8 --sizes 131072,524288 --iters 3 \
    --json $D/account.json > $D/account.log 2>&1
echo "account rc=$? $(date +%s)" >> $D/stages
fi
if has train; then
python benchmarks/bench_train_step.py --models frontier,g4 --sizes 65536,131072 --inputs random,text --iters 3 \
    --json $D/train_step.json --commit $COMMIT > $D/train.log 2>&1
echo "train rc=$? $(date +%s)" >> $D/stages
fi
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

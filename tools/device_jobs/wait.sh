#!/bin/bash
# Waits on job.sh (or, with `gate` second, gate.sh) up to $1 seconds (default 540: one
# device call), prints the logs' ends, and packs what there is into $OUT: results.tgz
# (JSON and logs, not the checkpoint) and the base's pieces once written (at most 8 files
# of 16 MiB come back).
if [ "$2" = gate ]; then
  D=/tmp/gate; end=$(( $(date +%s) + ${1:-540} ))
  while [ $(date +%s) -lt $end ] && ! grep -q '^done' $D/stages 2>/dev/null; do sleep 10; done
  cat $D/card.txt $D/stages 2>/dev/null
  for f in $D/*.log; do echo "== $f"; grep -v "^\s*$" $f | tail -${GATE_TAIL:-8}; done
  [ -n "$OUT" ] && tar czf $OUT/gate.tgz -C $D . 2>/dev/null && ls -la $OUT
  exit 0
fi
D=/tmp/g; end=$(( $(date +%s) + ${1:-540} ))
while [ $(date +%s) -lt $end ] && ! grep -q '^done' $D/stages 2>/dev/null; do sleep 10; done
cat $D/card.txt $D/env.txt $D/stages 2>/dev/null
for f in $D/account_*.log; do [ -f "$f" ] && { echo "== $f"; grep -v "^\s*$" $f | tail -${ACC:-40}; }; done
grep -v "^\s*$" $D/seed.log 2>/dev/null | tail -30
for f in $D/train_*.log; do [ -f "$f" ] && { echo "== $f"; tail -20 $f; }; done
grep -v "^\s*$" $D/gate_block.log 2>/dev/null | tail -8
if [ -n "$OUT" ]; then
  tar czf $OUT/results.tgz -C $D --exclude='seed0/base' --exclude='pieces0' . 2>/dev/null
  if [ -f $D/pieces0/base.index.json ]; then cp $D/pieces0/* $OUT/ 2>/dev/null; fi
  ls -la $OUT
fi

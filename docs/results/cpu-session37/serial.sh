#!/usr/bin/env bash
# the step alone at 1 and 2 torch threads, alternated: serial share s = 2*T2/T1 - 1
cd /work/main
P=data/bench/rmat1-1000000n-d20-f100-c47-tr0.1-ev0.005-a0.57-b0.19-c0.19-x0.1-s0-1part
for r in 1 2; do
  for th in 1 2; do
    .venv/bin/python -m benchmarks.step --parts $P --dropout 0 --num-threads $th 2>/dev/null | tail -1 | python3 -c "
import json,sys; d=json.loads(sys.stdin.read()); print('threads',$th,'round',$r,{k:d[k] for k in ('mfgserve_ms','mfgserve_cpu_ms','dgl_ms','dgl_cpu_ms','ratio')})"
  done
done

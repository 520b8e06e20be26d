#!/usr/bin/env bash
# The split-window A/B of session 37: worker mode, headline flags, one trainer, configurations
# run back to back REPS times. Each configuration is LABEL:SPLIT:NICE:THREADS:
#   SPLIT 1 = split-window.patch.txt on (MFGSERVE_HYBRID=1: the next window goes out before the
#   window's last step, which runs on 1 torch thread); NICE = --server-nice; THREADS =
#   --server-num-workers. Run from /tmp/wtH, a worktree of 1e3324b with that patch applied.
# The four sittings of split-window-ab.txt:
#   CONFIGS="A:0:0:2 B:1:19:2 C:0:19:2"            rmat, sitting 1
#   CONFIGS="A:0:0:2 B:1:19:2 D:1:19:1 E:1:0:1"     rmat, sitting 2
#   CONFIGS="A:0:0:2 F:1:0:2 E:1:0:1"               rmat, sitting 3
#   FAM=products CONFIGS="A:0:0:2 E:1:0:1"          products, two sittings (REPS=3, REPS=4)
cd /tmp/wtH
P=/work/main/data/bench/rmat1-1000000n-d20-f100-c47-tr0.1-ev0.005-a0.57-b0.19-c0.19-x0.1-s0-1part
[ "${FAM:-rmat}" = products ] && P=/work/main/data/bench/synthetic-1000000n-d20-f100-c47-tr0.1-ev0.005-s0-1part
run() {  # LABEL SPLIT NICE THREADS
  out=$(MFGSERVE_HYBRID=$2 /work/main/.venv/bin/python -m deploy.worker_mode --parts $P --num-trainers 1 \
    --epochs 1 --fanouts 15,10,5 --batch-size 1024 --hidden 256 --seed 0 --model sage --dropout 0 \
    --lr 0.003 --weight-decay 0.0005 --max-inflight 4 --prefetch auto --servers-per-part 1 \
    --server-num-workers $4 --server-sampler-procs 0 --no-progress --shm-ring --malloc-retain-mb 256 \
    --server-malloc-retain-mb 256 --server-nice $3 --work-dir /tmp/s37/wm 2>/dev/null | tail -1)
  echo "$out" | python3 -c "
import json,sys; d=json.loads(sys.stdin.read()); s=d['stages_s']; b=d['batches_per_epoch_per_trainer']
print('$1', d['seeds_per_s'], 'fb %.1f wait %.1f ms/batch'%(s['forward_backward_s']/b*1e3, s['trainer_wait_s']/b*1e3), 'loss', d.get('final_loss'), 'test', d['test_acc'], 'slots', d['shm_ring']['slots_used'], 'ring', d['shm_ring']['replies_in_ring'])"
}
for r in $(seq 1 ${REPS:-3}); do
  for c in ${CONFIGS:-A:0:0:2 E:1:0:1}; do run ${c//:/ }; done
done

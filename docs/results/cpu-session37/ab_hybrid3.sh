#!/usr/bin/env bash
# worker mode, rmat, headline flags; A: base; B: hybrid (next window sent before the window's
# last step, which runs on 1 thread) + servers at nice 19; C: base + servers at nice 19
cd /tmp/wtH  # a worktree of 1e3324b with split-window.patch.txt applied (MFGSERVE_HYBRID gates it)
P=/work/main/data/bench/rmat1-1000000n-d20-f100-c47-tr0.1-ev0.005-a0.57-b0.19-c0.19-x0.1-s0-1part
FAM=${FAM:-rmat}
[ "$FAM" = products ] && P=/work/main/data/bench/synthetic-1000000n-d20-f100-c47-tr0.1-ev0.005-s0-1part
run() {  # label env nice (W= sampler threads)
  out=$(env $2 /work/main/.venv/bin/python -m deploy.worker_mode --parts $P --num-trainers 1 --epochs 1 \
    --fanouts 15,10,5 --batch-size 1024 --hidden 256 --seed 0 --model sage --dropout 0 --lr 0.003 \
    --weight-decay 0.0005 --max-inflight 4 --prefetch auto --servers-per-part 1 --server-num-workers ${W:-2} \
    --server-sampler-procs 0 --no-progress --shm-ring --malloc-retain-mb 256 --server-malloc-retain-mb 256 \
    --server-nice $3 --work-dir /tmp/s37/wm 2>/dev/null | tail -1)
  echo "$out" | python3 -c "
import json,sys; d=json.loads(sys.stdin.read()); s=d['stages_s']; b=d['batches_per_epoch_per_trainer']
print('$1', d['seeds_per_s'], 'fb %.1f wait %.1f ms/batch'%(s['forward_backward_s']/b*1e3, s['trainer_wait_s']/b*1e3), 'loss', d.get('final_loss'), 'test', d['test_acc'], 'slots', d['shm_ring']['slots_used'], 'ring', d['shm_ring']['replies_in_ring'])"
}
for r in $(seq 1 ${REPS:-3}); do
  W=2 run A MFGSERVE_HYBRID=0 0


  W=1 run E MFGSERVE_HYBRID=1 0
done

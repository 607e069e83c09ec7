#!/bin/bash
#SBATCH --job-name=train
#SBATCH --time=04:00:00
#SBATCH --signal=USR1@120   # SIGUSR1 to the job's tasks 120 s (Slurm: up to 60 s more) before the end
#SBATCH --requeue           # the job may go back to the queue (scontrol requeue, node failure)
#SBATCH --open-mode=append  # a requeued run appends to the same output file
OUT=${OUT:-runs/exp1}
echo "job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1))"
srun python train.py "$OUT"  # resumes from the newest snapshot (or RAM) by itself
snapkeep status "$OUT"
case $? in
  0) exit 0 ;;                                         # finished
  75 | 79) scontrol requeue "$SLURM_JOB_ID"; exit 0 ;; # preempted: queue it again, it resumes
  *) exit 1 ;;                                         # failed, or died without a word
esac

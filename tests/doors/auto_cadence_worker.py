"""A plain loop with ``Checkpointer(every="auto")``: trains ``STEPS`` steps (10 ms each), SIGKILLs
itself right after step ``KILL_AT`` (0: never), prints each snapshot's step and the final
weights' checksum. Usage: auto_cadence_worker.py OUT_DIR STEPS KILL_AT"""

import hashlib
import os
import signal
import sys
import time

import torch

import snapkeep

out, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
optim = torch.optim.SGD(model.parameters(), lr=0.05)
with snapkeep.Checkpointer(out, every=snapkeep.AutoInterval(mtbf_s=1.0), keep=2) as ckpt:
    state = {"model": model, "optim": optim}
    start = ckpt.load(into=state) or 0
    for step in range(start + 1, steps + 1):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        time.sleep(0.01)
        if ckpt.save(step, state) is not None:
            print("saved", step, flush=True)
        if step == kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
print("final", digest.hexdigest(), flush=True)

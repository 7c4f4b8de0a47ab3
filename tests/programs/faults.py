"""A framework's example (the first argument, the rest its own) with a fault injected, for a
launcher to run on every rank.

Environment: STOP_AT: an agreed stop at the STOP_AT-th should_stop() call of every rank (the
requeue then only ends the process). CRASH_AT (the Lightning, Accelerate and Trainer examples):
the worker of rank CRASH_RANK (default 1) kills itself (SIGKILL, as the kernel's OOM killer does)
once its step reaches CRASH_AT, in the workers' first start only, for torchrun to restart them.
STUCK_FORK (a path): the first child forked from the process never gets past its fork (it writes
its pid there, then sleeps), as CPython's gh-112275 leaves a DataLoader worker forked from a
loaded Python 3.10.13 rank; slurmddp's birth limit for workers is 2 s.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

from slurmddp.preemption import api, workers

if os.environ.get("STUCK_FORK"):
    flag = Path(os.environ["STUCK_FORK"])
    workers.BIRTH_S = 2

    def first_child_hangs():
        if not flag.exists():
            flag.write_text(str(os.getpid()))
            time.sleep(3600)

    os.register_at_fork(after_in_child=first_child_hangs)

if os.environ.get("STOP_AT"):
    calls = []
    stop_at = int(os.environ["STOP_AT"])

    def should_stop(*args, **kwargs):
        calls.append(1)
        return len(calls) >= stop_at

    def requeue():
        raise SystemExit(0)

    api.should_stop, api.requeue = should_stop, requeue

if (os.environ.get("CRASH_AT") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        and os.environ.get("RANK", "0") == os.environ.get("CRASH_RANK", "1")):  # fmt: skip
    crash_at = int(os.environ["CRASH_AT"])
    if "hf_trainer" in os.path.basename(sys.argv[1]):
        from slurmddp.integrations import transformers

        step_end = transformers.StopProtocol.on_step_end

        def on_step_end(self, args, state, control, **kwargs):
            control = step_end(self, args, state, control, **kwargs)
            if state.global_step >= crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return control

        transformers.StopProtocol.on_step_end = on_step_end
    elif "accelerate" in os.path.basename(sys.argv[1]):
        from slurmddp.integrations import accelerate

        step = accelerate.Preemptible.step

        def stepped(self, n):
            step(self, n)
            if n >= crash_at:
                os.kill(os.getpid(), signal.SIGKILL)

        accelerate.Preemptible.step = stepped
    else:
        from slurmddp.integrations import lightning

        batch_end = lightning.StopProtocol.on_train_batch_end

        def on_train_batch_end(self, trainer, *args):
            batch_end(self, trainer, *args)
            if trainer.global_step >= crash_at:
                os.kill(os.getpid(), signal.SIGKILL)

        lightning.StopProtocol.on_train_batch_end = on_train_batch_end

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")

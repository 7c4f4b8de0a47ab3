"""How a rank starts DataLoader workers, in real processes: they outlive Slurm's signals until the
rank stops, their DataLoader still ends them, and one stuck in its fork is forked again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import launcher_free_env
from tests.preemption.test_signals import run_python

DATALOADER = """
    import multiprocessing as mp, os, subprocess, sys, time, torch, slurmddp
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self): return 10_000
        def __getitem__(self, i):
            time.sleep(0.002)
            return torch.tensor([i])

    if __name__ == "__main__":
        loader = DataLoader(Slow(), batch_size=4, num_workers=2,
                            multiprocessing_context=sys.argv[1])
        slurmddp.should_stop()
        for step, batch in enumerate(loader, 1):
            if step == 10:
                # What slurmstepd does: every process of the task's tree gets the signals, from
                # another process than the rank.
                tree = [str(os.getpid())] + [str(c.pid) for c in mp.active_children()]
                for sig in ("USR2", "TERM"):
                    subprocess.run(["kill", "-s", sig, *tree], check=True)
            time.sleep(0.02)
            # The ranks agree a step or two later: the workers must serve those steps.
            if step >= 15 and slurmddp.should_stop():
                alive = [c.is_alive() for c in mp.active_children()]
                print(f"stopped at step {step}; workers alive: {alive}", flush=True)
                break
"""


@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.floor),
                                    "forkserver", "fork"])
@pytest.mark.ranks
def test_dataloader_workers_outlive_slurms_signals_until_the_rank_stops(tmp_path, method):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DATALOADER))
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", str(script), method],
                       env=launcher_free_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "workers alive: [True, True]" in r.stdout
    assert "stopped at step 15" in r.stdout
    assert "killed by signal" not in r.stderr and "exited unexpectedly" not in r.stderr


@pytest.mark.ranks
def test_without_the_shield_a_spawned_worker_dies_of_slurms_term(tmp_path):
    # The same job with the DataLoader shield taken away fails: the test above can fail.
    script = tmp_path / "train.py"
    script.write_text("import slurmddp.patches as p, slurmddp.preemption.workers as w\n"
                      "p.remove(w.WORKER_START)\n"
                      + textwrap.dedent(DATALOADER))  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", str(script), "spawn"],
                       env=launcher_free_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode != 0
    # The rank learns of the dead worker one of two ways, by the race between the worker's death
    # and the rank's read: torch's own report, or the reset of the worker's half-sent batch.
    assert "DataLoader worker" in r.stderr or "ConnectionResetError" in r.stderr, r.stderr


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@pytest.mark.ranks
def test_a_dataloader_still_ends_its_workers_and_a_busy_pool_and_process_still_terminate(method):
    r = run_python(f"""
        import multiprocessing as mp, os, signal, time, torch, slurmddp
        from torch.utils.data import DataLoader
        slurmddp.should_stop()
        if __name__ == "__main__":
            ctx = mp.get_context({method!r})
            it = iter(DataLoader(list(range(100)), num_workers=2, multiprocessing_context=ctx))
            next(it)
            workers = list(it._workers)
            for w in workers:
                w.terminate()  # the DataLoader's own last resort at shutdown
            for w in workers:
                w.join(timeout=20)
            print("workers ended:", [w.exitcode for w in workers])
            with ctx.Pool(2) as pool:  # __exit__ terminates the pool's workers
                print(pool.map(abs, [-1, -2]))
                pool.apply_async(time.sleep, (60,))
                time.sleep(1)  # one worker is busy: only SIGTERM ends it
            print("pool ended")
            p = ctx.Process(target=time.sleep, args=(60,))
            p.start()
            time.sleep(1)
            p.terminate()
            p.join()
            print("process ended:", p.exitcode)
        """, timeout=40)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "workers ended: [0, 0]" in r.stdout
    assert "[1, 2]\npool ended\nprocess ended: -15" in r.stdout


STUCK_IN_FORK = """
    import os, sys, time, slurmddp
    from pathlib import Path
    from torch.utils.data import DataLoader
    from slurmddp.preemption import workers

    flag = Path(sys.argv[1])

    def first_child_hangs():
        # In the child, inside os.fork(), before any of the worker's own code: where a lock that
        # another thread of the rank held at the fork leaves it.
        if not flag.exists():
            flag.write_text(str(os.getpid()))
            time.sleep(3600)

    if __name__ == "__main__":
        workers.BIRTH_S = 2
        slurmddp.should_stop()
        os.register_at_fork(after_in_child=first_child_hangs)
        loader = DataLoader(list(range(40)), batch_size=4, num_workers=2,
                            multiprocessing_context=sys.argv[2])
        epochs = [[b.tolist() for b in loader] for _ in range(2)]
        print("batches as without a stuck fork:",
              epochs == [[list(range(i, i + 4)) for i in range(0, 40, 4)]] * 2)
        try:
            os.kill(int(flag.read_text()), 0)
            print("the stuck child is still there")
        except ProcessLookupError:
            print("the stuck child is gone")
"""


def test_a_worker_stuck_in_its_fork_is_forked_again_and_the_loader_yields_all_it_should(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(STUCK_IN_FORK))
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", str(script), str(tmp_path / "flag"),
                        "fork"], env=launcher_free_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "batches as without a stuck fork: True\nthe stuck child is gone" in r.stdout
    stuck = (tmp_path / "flag").read_text()
    assert r.stderr.count("stuck in its fork") == 1, r.stderr
    assert f"a DataLoader worker (pid {stuck}) was stuck in its fork for 2 s; it was killed and " \
           "forked again" in r.stderr


MANY_DESCRIPTORS = """
    import os, resource, slurmddp
    from torch.utils.data import DataLoader

    if __name__ == "__main__":
        slurmddp.should_stop()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # past select()'s 1024
        loader = DataLoader(list(range(16)), batch_size=4, num_workers=2,
                            multiprocessing_context="fork")
        print("samples:", sum(len(b) for b in loader), "highest descriptor:", max(held))
"""


def test_a_rank_with_more_than_1024_descriptors_still_starts_its_forked_workers(tmp_path):
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048:
        pytest.skip("the hard limit on open files is below 2048 here")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(MANY_DESCRIPTORS))
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", str(script)],
                       env=launcher_free_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    samples, highest = r.stdout.split("samples:")[1].split("highest descriptor:")
    assert int(samples) == 16 and int(highest) > 1024

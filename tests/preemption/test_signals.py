"""How a rank takes signals, in real processes: flags, masks inherited by children, SIGTERM kept
as it is for scripts that never ask, DataLoader workers that outlive Slurm's signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from slurmddp.errors import SignalError
from slurmddp.preemption import signals
from tests.conftest import launcher_free_env


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, signal.SIGUSR2), ({"SLURMDDP_SIGNAL": "USR1"}, signal.SIGUSR1),
     ({"SLURMDDP_SIGNAL": "SIGTERM"}, signal.SIGTERM)],
)  # fmt: skip
def test_stop_signal_comes_from_the_batch_script_or_defaults_to_usr2(environ, expected):
    assert signals.stop_signal(environ) == expected


def test_an_unknown_stop_signal_is_named():
    with pytest.raises(SignalError, match="SLURMDDP_SIGNAL='USR9' is not a signal name"):
        signals.stop_signal({"SLURMDDP_SIGNAL": "USR9"})


def run_python(code: str, *prefix: str, timeout: float = 120, **env: str):
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)],
                          env=launcher_free_env(**env), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


BLOCKED = """
    def blocked(pid="self"):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigBlk:"):
                mask = int(line.split()[1], 16)
                return sorted(s for s in (10, 12, 15) if mask >> (s - 1) & 1)
"""


@pytest.mark.parametrize("sig", ["USR2", "USR1"])
def test_the_stop_signal_sets_the_flag_and_children_never_see_it(sig):
    r = run_python(textwrap.dedent(BLOCKED) + textwrap.dedent(f"""
        import os, signal, subprocess, sys, time, slurmddp
        from slurmddp.preemption import api as preemption
        preemption.install()
        before = slurmddp.should_stop()
        os.kill(os.getpid(), signal.SIG{sig})
        time.sleep(0.2)
        child = subprocess.run([sys.executable, "-c", "import os, signal, time; "
                                "os.kill(os.getpid(), signal.SIG{sig}); time.sleep(0.1); "
                                "print('child alive')"], capture_output=True, text=True)
        print(before, preemption.received().name, slurmddp.should_stop(), blocked(),
              child.stdout.strip())
        """), SLURMDDP_SIGNAL=sig)  # fmt: skip
    assert r.returncode == 0, r.stderr
    number = signal.Signals[f"SIG{sig}"].value
    assert r.stdout.split("[")[0].split() == ["False", f"SIG{sig}", "True"]
    assert f"[{number}] child alive" in r.stdout  # blocked in the main thread, and in the child
    assert f"{sig} received: every rank stops" in r.stderr


def test_term_keeps_its_default_effect_until_the_script_asks():
    r = run_python("""
        import os, signal, time
        from slurmddp.preemption import api as preemption
        preemption.install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived")
        """)  # fmt: skip
    assert r.returncode == -signal.SIGTERM and "survived" not in r.stdout


def test_once_the_script_asks_term_stops_it_at_the_agreed_step():
    r = run_python("""
        import os, signal, time, slurmddp
        print(slurmddp.should_stop())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print(slurmddp.should_stop())
        """)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]
    assert "TERM received: every rank stops" in r.stderr


def test_a_term_handler_of_the_script_still_runs_whether_installed_before_or_after():
    r = run_python("""
        import os, signal, time, slurmddp
        from slurmddp.preemption import api
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append("before"))
        slurmddp.should_stop()
        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)
        print(got, api.state().receiver.seen)
        # A framework replacing the handler later (Lightning does, chaining the one it found).
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda s, f: (got.append("after"), previous(s, f)))
        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)
        print(got)
        """)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["['before'] 2", "['before', 'after', 'before']"]


def test_take_back_reclaims_both_signals_from_a_framework_without_chaining_it():
    r = run_python("""
        import os, signal, time, slurmddp
        from slurmddp.preemption import api
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append("script's"))
        slurmddp.should_stop()  # takes TERM, chaining the script's handler
        # A framework (Lightning as fit starts) replaces both, chaining what it found.
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            previous = signal.getsignal(sig)
            signal.signal(sig, lambda s, f, p=previous: (got.append("framework's"), p(s, f)))
        api.state().receiver.take_back()
        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR2); time.sleep(0.1)
        print(got, api.received().name, slurmddp.should_stop())
        """)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[\"script's\"]", "SIGUSR2", "True"]


def test_an_ignored_term_stays_ignored():
    r = run_python("""
        import os, signal, time, slurmddp
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        slurmddp.should_stop()
        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)
        print(slurmddp.should_stop())
        """)  # fmt: skip
    assert (r.returncode, r.stdout.strip()) == (0, "False"), r.stderr


def test_a_stop_signal_before_the_runner_took_it_is_read_from_the_stop_file(tmp_path):
    stop = tmp_path / "stop"
    code = """
        import os, signal, time
        os.kill(os.getpid(), signal.SIGUSR2)  # as python starts: before any handler
        time.sleep(0.2)
        import slurmddp
        print(slurmddp.should_stop())
    """
    bare = run_python(code, SLURMDDP_STOP_FILE=str(stop))
    assert bare.returncode == -signal.SIGUSR2  # what happens without the batch script's prefix
    stop.write_text("USR2\n")  # what the batch shell leaves before it passes the signal on
    r = run_python(code, *signals.ignoring("USR2"), SLURMDDP_STOP_FILE=str(stop))
    assert (r.returncode, r.stdout.strip()) == (0, "True"), r.stderr


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


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
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


def test_without_the_shield_a_spawned_worker_dies_of_slurms_term(tmp_path):
    # The same job with the DataLoader shield taken away fails: the test above can fail.
    script = tmp_path / "train.py"
    script.write_text("import multiprocessing.process as p, slurmddp.preemption.signals as s\n"
                      "p.BaseProcess.start = s._original_start\n"
                      + textwrap.dedent(DATALOADER))  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", str(script), "spawn"],
                       env=launcher_free_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode != 0
    # The rank learns of the dead worker one of two ways, by the race between the worker's death
    # and the rank's read: torch's own report, or the reset of the worker's half-sent batch.
    assert "DataLoader worker" in r.stderr or "ConnectionResetError" in r.stderr, r.stderr


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
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

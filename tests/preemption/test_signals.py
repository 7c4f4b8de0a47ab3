"""How a rank takes signals, in real processes: flags, masks inherited by children, SIGTERM kept
as it is for scripts that never ask."""

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

"""slurmddp.init in a real process: gloo on CPU, twice-safe, errors for impossible backends."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

from tests.conftest import launcher_free_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=launcher_free_env(**env), capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_init_joins_a_gloo_group_and_is_safe_to_call_twice():
    r = run_python(
        """
        import json, os, slurmddp, torch.distributed as td
        first = slurmddp.init(timeout=30)
        second = slurmddp.init(timeout=30)
        t = __import__("torch").ones(1)
        td.all_reduce(t)
        print(json.dumps({"same": first is second, "backend": td.get_backend(),
                          "world": td.get_world_size(), "sum": t.item(),
                          "exported": os.environ["LOCAL_WORLD_SIZE"],
                          "launcher": first.launcher}))
        td.destroy_process_group()
        """,
        MASTER_PORT=str(free_port()),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"same": True, "backend": "gloo", "world": 1, "sum": 1.0,
                                    "exported": "1", "launcher": "single"}  # fmt: skip


def test_two_ranks_reduce_across_processes():
    port = str(free_port())
    code = """
        import slurmddp, torch, torch.distributed as td
        d = slurmddp.init("gloo", timeout=60)
        t = torch.tensor([float(d.rank + 1)])
        td.all_reduce(t)
        print(int(t.item()))
        td.destroy_process_group()
        """
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=launcher_free_env(RANK=str(r), WORLD_SIZE="2",
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip() for o, _ in outs] == ["3", "3"]


def test_nccl_without_a_gpu_is_a_clear_error():
    r = run_python(
        """
        import slurmddp
        from slurmddp.placement import PlacementError
        try:
            slurmddp.init("nccl")
        except PlacementError as e:
            print("ERR", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "ERR backend nccl needs a CUDA GPU and none is visible: use gloo" in r.stdout


def test_doctor_check_on_a_single_process():
    r = subprocess.run([sys.executable, "-m", "slurmddp", "doctor", "--check", "--timeout", "30"],
                       env=launcher_free_env(MASTER_PORT=str(free_port())), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "all checks passed" in r.stdout


def test_doctor_bad_environment_is_one_line():
    r = subprocess.run([sys.executable, "-m", "slurmddp", "doctor"],
                       env=launcher_free_env(RANK="1"), capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "slurmddp doctor: error: cannot resolve this rank: RANK is set but WORLD_SIZE is not: "
        "set both or neither"
    )

"""Shared fixtures. `slurm_cluster` brings up the real local Slurm cluster once per session."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurmddp.protocol import PORT_RANGE_VAR

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SCRIPT = ROOT / "scripts" / "slurm-cluster"
PROGRAMS = Path(__file__).resolve().parent / "programs"

# Variables of any launcher this test process may itself run under; a step we start must not
# inherit them.
_LAUNCHER_PREFIXES = ("SLURM_", "SLURMD_", "OMPI_", "PMI", "MV2_", "TORCHELASTIC_", "MPI_LOCAL")
_TORCHRUN_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT")  # fmt: skip


# The Slurm versions of the local clusters (scripts/slurm-cluster), and those a cluster test runs on
# in scripts/test unless its `slurm` marker names others: one, for what no version changes.
SLURM_VERSIONS = ("22.05", "24.11", "26.05")
DEFAULT_SLURM = ("22.05",)
# What the versions may do differently (the signals, requeue, placement, host lists, the job's
# fields): such a test runs on all three. docs/developers/testing.md has the whole matrix.
EVERY_SLURM = pytest.mark.slurm(*SLURM_VERSIONS)
# What no version changes, run on 24.11 instead of the default: tests that mostly wait (on
# SlurmdTimeout, a hang timeout, a controller's restart), taken out of the 22.05 pass, which was the
# longest of scripts/test's chains.
ELSEWHERE_SLURM = pytest.mark.slurm("24.11")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slurm-matrix", action="store_true",
                     help="run each cluster test only on the Slurm versions its slurm marker "
                          "names (default 22.05): scripts/test's passes")  # fmt: skip


def slurm_versions(item: pytest.Item) -> tuple[str, ...]:
    """The Slurm versions a cluster test runs on in scripts/test (docs/developers/testing.md)."""
    marker = item.get_closest_marker("slurm")
    versions = tuple(marker.args) if marker else DEFAULT_SLURM
    unknown = set(versions) - set(SLURM_VERSIONS)
    if unknown or not versions:
        raise pytest.UsageError(f"{item.nodeid}: slurm marker names {versions}: give some of "
                                f"{SLURM_VERSIONS}")  # fmt: skip
    return versions


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With --slurm-matrix, a cluster test runs only on the versions it names. The container tests
    run last in their session: building their image takes about 2.5 GB of disk for a minute or
    two, which early in a fresh CI run would come on top of the floor venv's install (pip holds
    its 3.7 GB of downloads beside the 7 GB they unpack to)."""
    if config.getoption("--slurm-matrix"):
        elsewhere = [item for item in items if item.get_closest_marker("cluster")
                     and SLURM_VERSION not in slurm_versions(item)]  # fmt: skip
        if elsewhere:
            config.hook.pytest_deselected(items=elsewhere)
            dropped = set(elsewhere)
            items[:] = [item for item in items if item not in dropped]
    items.sort(key=lambda item: item.get_closest_marker("container") is not None)


def launcher_free_env(**extra: str) -> dict[str, str]:
    """os.environ without launcher variables, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _TORCHRUN_NAMES
    }
    return env | extra


def lone_rank_env(**extra: str) -> dict[str, str]:
    """launcher_free_env for a lone rank outside any job: one OpenMP thread, and a free
    MASTER_PORT of its own. Without one it listens on torch's default, 29500, which the same test
    takes in the floor's pass beside the unit pass (a fresh run failed so)."""
    return launcher_free_env(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()), **extra)


# Ports a test's own ranks never listen on: the local clusters' job ranges and daemons, and
# slurmddp's default job range (scripts/slurm-cluster's port plan: 5000-32767).
_PROJECT_PORTS = range(5000, 32768)


# Where free_port records the ports it handed out, for every pytest of this user on this machine
# (scripts/test runs five side by side): one lock, one file per port, its time the handout's.
_PORT_CLAIMS = Path(f"/tmp/slurmddp-test-ports-{os.getuid()}")
# How long a handed-out port stays another test's: from the pick to its rank 0's bind, and to a
# second run's bind where a test starts its ranks again on the same port.
_PORT_CLAIM_S = 900


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask set to `mask` for the block."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def free_port() -> int:
    """A TCP port nothing listens on now, for a test's rank 0 to listen on next. Never one of the
    kernel's ephemeral ports: any outgoing connection may take one of those between this check
    and the rank's bind (CI runs passes side by side, and gloo opens many), which failed a
    process group's start. Nor one of the local clusters' or slurmddp's (_PROJECT_PORTS). Nor
    one handed to another test in the last _PORT_CLAIM_S seconds, in any pytest of this machine:
    two passes' tests picked the same port before either bound it, and one's rank 0 found it
    taken."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = [p for p in range(1024, 65536)
                  if not low <= p <= high and p not in _PROJECT_PORTS]  # fmt: skip
    _PORT_CLAIMS.mkdir(mode=0o700, exist_ok=True)
    with open(_PORT_CLAIMS / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        claimed = set()
        for claim in _PORT_CLAIMS.glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if now - claim.stat().st_mtime < _PORT_CLAIM_S:
                    claimed.add(int(claim.name))
                else:
                    claim.unlink()
        for port in random.sample(candidates, min(100, len(candidates))):
            if port in claimed:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            (_PORT_CLAIMS / str(port)).touch()
            return port
    raise RuntimeError(f"no free port outside {low}-{high} (ephemeral) and {_PROJECT_PORTS}")


# Which Slurm the cluster tests run on: scripts/slurm-cluster reads the same variable (22.05 on
# this host, 24.11 and 26.05 in Debian roots whose commands come first on PATH).
SLURM_VERSION = os.environ.get("SLURMDDP_SLURM", "22.05")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The running local cluster: where its config lives, and helpers to run steps on it."""

    slurm_conf: str
    path: str  # with the version's Slurm commands first
    etcd: str  # HOST:PORT of the cluster's etcd (v2 API on)
    state_dir: Path  # scripts/slurm-cluster's: configs, logs, the daemons' pid files in run/
    node_netns: str  # a node's network namespace, "{node}" in it: each node is a host of its own
    host_addr: str  # where the nodes reach the cluster's daemons (this host, on their bridge)
    hosts: dict[str, str]  # what a node name (n1) or its management name (n1-mgmt) resolves to
    version: str = SLURM_VERSION

    def address(self, name: str) -> str:
        """The address `name` (n1, n1-mgmt) resolves to on the cluster's nodes."""
        return self.hosts[name]

    def env(self, **extra: str) -> dict[str, str]:
        return launcher_free_env(SLURM_CONF=self.slurm_conf, PATH=self.path) | extra

    def run(self, argv: list[str], timeout: float = 180, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command (srun, sbatch, scontrol...) and capture its output."""
        return subprocess.run(
            argv, env=kw.pop("env", None) or self.env(), capture_output=True, text=True,
            timeout=timeout, **kw,
        )  # fmt: skip

    def on_node(self, node: str) -> list[str]:
        """The command line's start that runs the rest as a process of `node` (its network)."""
        return ["nsenter", f"--net={self.node_netns.format(node=node)}", "--"]

    def srun(self, srun_args: list[str], command: list[str], **kw) -> subprocess.CompletedProcess:
        return self.run(["srun", "--kill-on-bad-exit=1", *srun_args, *command], **kw)

    def link_cut(self, node: str) -> contextlib.AbstractContextManager[None]:
        """`node`'s data link down for the block, then up again (`benchmarks.cluster.link_cut`):
        its processes live on."""
        from benchmarks.cluster import link_cut  # (it imports torch: not every test's cost)

        return link_cut(node, self.node_netns)

    @contextlib.contextmanager
    def variant(self, name: str) -> Iterator[None]:
        """The cluster in configuration `name` (scripts/slurm-cluster variant), then standard."""
        _switch(name)
        try:
            yield
        finally:
            _switch("standard")


def _switch(name: str) -> None:
    r = subprocess.run([str(CLUSTER_SCRIPT), "variant", name], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    if r.returncode != 0:
        pytest.fail(f"cannot switch the cluster to variant {name}:\n{r.stdout}\n{r.stderr}")


def handed_plan(script: str):
    """The `slurmddp.supervisor.plan.Plan` a rendered batch script hands its supervisor."""
    import shlex

    from slurmddp.supervisor.plan import Plan

    line = script[script.index("--plan "):].partition("\n")[0]  # the plan is one line of JSON
    return Plan.from_json(shlex.split(line)[1])


def handed_step(script: str, **variables: str) -> list[str]:
    """The step a rendered batch script's supervisor runs, given Slurm's `variables`."""
    from slurmddp.supervisor.launchers import Run, launcher

    plan = handed_plan(script)
    return list(launcher(plan.launcher).step(plan, Run.of({"SLURM_JOB_ID": "7",
                                                            "SLURM_JOB_NODELIST": "n[1-2]",
                                                            **variables})).argv)  # fmt: skip


def tagged_json(stdout: str, tag: str) -> list[dict]:
    """The JSON payloads of every output line that starts with `tag`. A payload that says whether
    its parameters are finite must say they are: a diverged training's digest of NaNs equals
    every other's, and would prove any resume bitwise."""
    payloads = [json.loads(line.split(tag, 1)[1]) for line in stdout.splitlines() if tag in line]
    assert all(p.get("finite", True) for p in payloads if isinstance(p, dict)), payloads
    return payloads


@pytest.fixture(scope="session")
def slurm_cluster() -> Cluster:
    """The real four-node cluster of scripts/slurm-cluster; a failure to start fails the test."""
    up = subprocess.run([str(CLUSTER_SCRIPT), "up"], capture_output=True, text=True, timeout=900)
    if up.returncode != 0:
        pytest.fail(f"the local Slurm cluster did not come up:\n{up.stdout}\n{up.stderr}")
    shown = cluster_env()
    # The clusters share this host with each other and with jobs outside them (scripts/test runs
    # a pass on each at once), so a job whose derived port met another's, or a daemon's, would
    # fail to listen: each cluster's jobs take theirs from a range of its own.
    os.environ.setdefault(PORT_RANGE_VAR, shown[PORT_RANGE_VAR])
    hosts = dict(pair.split("=", 1) for pair in shown["SLURMDDP_TEST_HOSTS"].split())
    return Cluster(shown["SLURM_CONF"], shown["PATH"], shown["SLURMDDP_TEST_ETCD"],
                   Path(shown["SLURMDDP_TEST_CLUSTER_DIR"]), shown["SLURMDDP_TEST_NODE_NETNS"],
                   shown["SLURMDDP_TEST_HOST_ADDR"], hosts)  # fmt: skip


CLUSTER_ENV = ("SLURM_CONF", "SLURMDDP_TEST_ETCD", "SLURMDDP_TEST_CLUSTER_DIR", PORT_RANGE_VAR,
               "SLURMDDP_TEST_NODE_NETNS", "SLURMDDP_TEST_HOST_ADDR", "SLURMDDP_TEST_HOSTS", "PATH")


def cluster_env() -> dict[str, str]:
    """The variables of `scripts/slurm-cluster env` (CLUSTER_ENV): SLURM_CONF, PATH, the etcd
    endpoint, the state directory, the range of its jobs' ports, the path of a node's network
    namespace (``{node}`` in it), this host's address on the nodes' network and their names'."""
    shown = subprocess.run(["bash", "-c", f'eval "$({CLUSTER_SCRIPT} env)" && printf "%s\\n" '
                            + " ".join(f'"${name}"' for name in CLUSTER_ENV)],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    return dict(zip(CLUSTER_ENV, shown.split("\n"), strict=False))


# -- a cluster test leaves the cluster as it found it ---------------------------------------------
# Jobs a wider fixture submitted (a module's jobs, shared by its parametrized tests): cancelled when
# that fixture is torn down, not after each test that reads them.
_FIXTURE_JOBS: set[str] = set()


def _session_dirs(request: pytest.FixtureRequest) -> tuple[str, str]:
    """Where this session's jobs are submitted from: its directory and its temporary ones."""
    return (str(request.config.invocation_params.dir),
            str(request.getfixturevalue("tmp_path_factory").getbasetemp()))  # fmt: skip


def _queued(cluster: Cluster, dirs: tuple[str, str]) -> set[str]:
    """This session's jobs pending or running: those submitted from its `dirs` (another session
    on the same cluster keeps its own), and not those already completing (their end is under way:
    a test whose job just ended need not wait for it)."""
    r = cluster.run(["squeue", "-h", "-t", "PD,R,S,CF,RQ,RS,RH,SO,ST", "-o", "%i|%Z"], timeout=60)
    lines = r.stdout.splitlines() if r.returncode == 0 else []
    jobs = (line.split("|", 1) for line in lines if "|" in line)
    return {job for job, workdir in jobs if workdir.startswith(dirs)}


def _clear(cluster: Cluster, dirs: tuple[str, str], jobs: set[str]) -> None:
    """Cancel `jobs`, wait until none of them runs or waits, and bring back to service the nodes a
    test left drained or down: the next test finds the cluster as `up` leaves it."""
    if jobs:
        cluster.run(["scancel", *sorted(jobs)], timeout=60)
        deadline = time.monotonic() + 90
        while _queued(cluster, dirs) & jobs and time.monotonic() < deadline:
            time.sleep(0.5)
    states = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=60).stdout.split()
    # Pairs of node and state; a state's suffix (*: not responding, ...) does not matter here.
    nodes = dict(zip(states[::2], (s.rstrip("*~#!%$@^-") for s in states[1::2]), strict=True))
    unusable = sorted(n for n, state in nodes.items() if state in ("drain", "drng", "down", "fail"))
    if unusable:
        cluster.run(["scontrol", "update", f"NodeName={','.join(unusable)}", "State=RESUME"],
                    timeout=60)  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Jobs submitted while a module- or session-wide fixture that asks for the cluster sets up
    belong to it."""
    wide = fixturedef.scope != "function" and "slurm_cluster" in fixturedef.argnames
    cluster = request.getfixturevalue("slurm_cluster") if wide else None
    dirs = _session_dirs(request) if cluster else ("", "")
    before = _queued(cluster, dirs) if cluster else set()
    yield
    if cluster:
        mine = _queued(cluster, dirs) - before
        _FIXTURE_JOBS.update(mine)

        def cancel() -> None:
            _clear(cluster, dirs, mine)
            _FIXTURE_JOBS.difference_update(mine)

        fixturedef.addfinalizer(cancel)


_FAILED = pytest.StashKey[bool]()  # on a test item: one of its phases failed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        item.stash[_FAILED] = True


@pytest.fixture(autouse=True)
def _torch_left_as_torch_made_it() -> Iterator[None]:
    """After a test that started exact data loading in this process (an integration's object,
    say), torch's DataLoader put back: the next tests meet torch's own."""
    yield
    loading = sys.modules.get("slurmddp.training.loader")
    if loading is not None and loading.installed():
        loading.uninstall()


@pytest.fixture(autouse=True)
def _cluster_left_clean(request) -> Iterator[None]:
    """After a cluster test, passed or failed: its jobs cancelled and the nodes in service. After a
    failed one, also every daemon running (`up`; a test that stopped one may have failed before
    starting it again), so one failure never holds the nodes or the daemons of the next tests."""
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    cluster = request.getfixturevalue("slurm_cluster")
    dirs = _session_dirs(request)
    yield
    if request.node.stash.get(_FAILED, False):
        subprocess.run([str(CLUSTER_SCRIPT), "up"], capture_output=True, timeout=300)
    _clear(cluster, dirs, _queued(cluster, dirs) - _FIXTURE_JOBS)


@pytest.fixture(scope="session")
def container_image(slurm_cluster, tmp_path_factory) -> str:
    """The path of an Apptainer image holding slurmddp's wheel (built from this checkout, as the
    tests' own install is) and torch, built by `scripts/slurm-cluster image` (26.05's root has
    Apptainer) and kept while the wheel is the same."""
    if SLURM_VERSION != "26.05":
        pytest.fail("the container tests need Apptainer, in Slurm 26.05's root: run them with "
                    "SLURMDDP_SLURM=26.05")  # fmt: skip
    dist = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(ROOT)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = dist.glob("slurmddp-*.whl")
    r = subprocess.run([str(CLUSTER_SCRIPT), "image", str(wheel), sys.executable],
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    if r.returncode != 0:
        pytest.fail(f"the test image was not built:\n{r.stdout}\n{r.stderr}")
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


RUNTIME_VENV = Path(os.environ.get("SLURMDDP_RUNTIME_VENV", ROOT / ".venv-runtime"))


@pytest.fixture(scope="session")
def runtime_python() -> str:
    """The interpreter of a venv of torch, slurmddp's wheel and its declared dependencies and
    nothing more (`scripts/install --runtime`, as scripts/demo makes it): made or brought up to
    date first (seconds when it is: scripts/install's stamps), one pytest at a time."""
    with open(f"/tmp/slurmddp-runtime-venv-{os.getuid()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = subprocess.run([str(ROOT / "scripts" / "install"), "--runtime"],
                              env=launcher_free_env(SLURMDDP_VENV=str(RUNTIME_VENV)),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    return str(RUNTIME_VENV / "bin" / "python")


def wait_until(predicate, timeout: float, what: str | Callable[[], str], interval: float = 0.5):
    """predicate()'s first true value; fails naming `what` (or `what()`) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")


def _reference(cluster, tmp_path_factory, per_node: int) -> str:
    """The digest every rank of an uninterrupted 300-step run of examples/resumable_train.py on
    2 nodes x `per_node` ranks ends with (the world size decides the bits)."""
    from tests.preemption.test_preemption_cluster import Job, train_args

    tmp = tmp_path_factory.mktemp(f"reference-2x{per_node}")
    job = Job(cluster, tmp, train_args(tmp / "ckpt", steps=300, step_time=0, per_node=per_node))
    end = job.wait_end()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log
    digests = {x["digest"] for x in job.results()}
    assert len(digests) == 1 and len(job.results()) == 2 * per_node, job.results()
    return digests.pop()


@pytest.fixture(scope="session")
def reference_digest(slurm_cluster, tmp_path_factory) -> str:
    """The parameters of an uninterrupted run of examples/resumable_train.py (2 nodes x 2 ranks,
    300 steps), which the tests interrupt in every way and compare bit for bit: the shape of the
    tests whose claim needs two ranks on a node (a signal's fan-out to a node's tasks, a node's
    loss taking two ranks)."""
    return _reference(slurm_cluster, tmp_path_factory, per_node=2)


@pytest.fixture(scope="session")
def reference_digest_2x1(slurm_cluster, tmp_path_factory) -> str:
    """The same uninterrupted run on 2 nodes x 1 rank (half the rank starts): the shape of the
    tests whose claim does not depend on the ranks a node holds."""
    return _reference(slurm_cluster, tmp_path_factory, per_node=1)

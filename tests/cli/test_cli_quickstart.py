"""`slurmddp quickstart`: the complete train.py of Getting started, shipped in the wheel, and run
as written: stopped twice under --local, it ends bitwise where the uninterrupted run ends."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from slurmddp.cli import quickstart
from tests.cli.test_cli_submit import slurmddp
from tests.conftest import tagged_json
from tests.test_examples import launch

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_loop_is_train_pys_and_the_page_shows_train_py_whole():
    section = (ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)[1]
    loop = block.split("\n\n", 1)[1]  # after its imports
    shipped = quickstart.script()
    assert textwrap.indent(loop, "    ") in shipped
    assert shipped == (ROOT / "templates" / "train.py").read_text()
    page = (ROOT / "docs" / "getting-started.md").read_text()
    assert f"```python\n{shipped}```" in page  # the page's train.py is the one users get


def test_it_writes_train_py_once_and_never_over_a_users_file(tmp_path):
    state = tmp_path / "state"
    r = slurmddp("quickstart", str(tmp_path), cwd=tmp_path, state=state)
    assert r.returncode == 0 and (tmp_path / "train.py").read_text() == quickstart.script()
    assert "--local-signal-after 40steps,80steps" in r.stdout
    (tmp_path / "train.py").write_text("mine\n")
    again = slurmddp("quickstart", str(tmp_path), cwd=tmp_path, state=state)
    assert again.returncode == 2 and (tmp_path / "train.py").read_text() == "mine\n"
    assert again.stderr.count("\n") == 1 and "exists: move it away" in again.stderr
    missing = slurmddp("quickstart", str(tmp_path / "nowhere"), cwd=tmp_path, state=state)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


@pytest.mark.ranks
def test_train_py_as_written_stopped_under_local_ends_bitwise_as_uninterrupted(tmp_path):
    # As Getting started has it: `slurmddp quickstart`, then `submit --local`, stopped at the
    # 10th step of its first run (1 node of 2 ranks and 2 epochs of 32 steps here, for time;
    # 0.05 s a step, so that the signal, which srun takes only 2 s after its start, comes while
    # it trains); against the same train.py run uninterrupted by `python -m slurmddp.run`.
    for name in ("uninterrupted", "stopped"):
        (tmp_path / name).mkdir()
        assert slurmddp("quickstart", cwd=tmp_path / name, state=tmp_path / "state").returncode == 0
    reference = launch(tmp_path / "uninterrupted", tmp_path / "uninterrupted" / "train.py",
                       "--epochs", "2").check().result  # fmt: skip
    r = slurmddp("submit", "--local", "--follow", "--nodes", "1", "--ntasks-per-node", "2",
                 "--local-signal-after", "10steps", "train.py", "--epochs", "2", "--step-time",
                 "0.05",
                 cwd=tmp_path / "stopped", state=tmp_path / "state", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("started on localhost") == 2 and "resumed at step " in r.stdout
    assert tagged_json(r.stdout, "RESULT ")[-1] == reference  # steps and digest
    assert reference["steps"] == 64  # 2 epochs of 1024 points, 16 a batch, 2 ranks

"""slurmddp.protocol is the one place for the names and statuses the processes share: the batch
script template and every module take them from there."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
from pathlib import Path

from slurmddp import errors, protocol
from slurmddp.batch.script import templating
from slurmddp.batch.script.sbatch import DEFAULT_TEMPLATE, context
from slurmddp.preemption import api, decision, signals
from tests.batch.script.test_sbatch import CASES
from tests.conftest import ROOT

TEMPLATE = ROOT / "templates" / DEFAULT_TEMPLATE
PACKAGE = ROOT / "slurmddp"


def template_code() -> str:
    """The template without its Jinja comments (prose may name what it describes)."""
    return re.sub(r"\{#.*?#\}", "", TEMPLATE.read_text(), flags=re.S)


def test_every_variable_name_is_a_unique_slurmddp_name():
    names = {k: v for k, v in protocol.template_names().items() if k.endswith("_VAR")}
    assert len(names) >= 14
    assert all(v.startswith("SLURMDDP_") for v in names.values()), names
    assert len(set(names.values())) == len(names)
    assert {v for v, _ in protocol.STATE_FILES} <= set(names.values())


def test_the_template_spells_no_protocol_name_and_no_status():
    code = template_code()
    assert "SLURMDDP_" not in code
    assert not re.search(r"\bexit\s+[0-9]", code), "an exit status written in the template"
    for status in (protocol.NOT_REQUEUED_STATUS, protocol.LOCAL_REQUEUE_STATUS):
        assert not re.search(rf"(?<![\w.]){status}(?!\w)", code), status


def test_every_protocol_name_the_template_uses_exists():
    used = set(re.findall(r"\bp\.(\w+)", template_code()))
    assert {"DONE_FILE_VAR", "RUN_ID_VAR", "SUCCESS", "SUPERVISOR_MODULE"} <= used
    assert used <= set(protocol.template_names()), used - set(protocol.template_names())
    assert all(hasattr(protocol, name) for name in used)


def test_the_rendered_script_gets_every_name_through_its_context():
    # Rename every protocol name in the context: not one SLURMDDP_ name may be left, and the
    # renamed ones must be there, so each name the script uses came from the context.
    def renamed(value: object) -> object:
        return value.replace("SLURMDDP_", "SDDPTEST_") if isinstance(value, str) else value

    for name, spec in CASES.items():
        ctx = context(spec).variables()
        ctx["p"] = {k: renamed(v) for k, v in protocol.template_names().items()}
        ctx["state_files"] = tuple((renamed(n), f) for n, f in protocol.STATE_FILES)
        ctx["protocol_env"] = tuple((renamed(n), v) for n, v in ctx["protocol_env"])
        script = templating.render(DEFAULT_TEMPLATE, **ctx)
        assert "SLURMDDP_" not in script, name
        for var, _ in protocol.STATE_FILES:
            assert f"export {renamed(var)}=" in script, (name, var)
        assert "$SDDPTEST_DONE_FILE" in script
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_no_module_spells_a_slurmddp_variable_itself():
    # Docstrings and messages may name a variable; a string that *is* one is a second spelling.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "protocol.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"SLURMDDP_[A-Z_]+", node.value):  # fmt: skip
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not found, found


def test_the_modules_share_the_protocols_values():
    assert decision.NOT_REQUEUED_STATUS == api.NOT_REQUEUED_STATUS == 75
    assert api.LOCAL_REQUEUE_STATUS == protocol.LOCAL_REQUEUE_STATUS
    assert (errors.USAGE_ERROR, errors.INTERNAL_ERROR) == (protocol.USAGE_ERROR,
                                                            protocol.INTERNAL_ERROR)  # fmt: skip
    assert signals.stop_signal({}).name == f"SIG{protocol.DEFAULT_SIGNAL}"
    facts = decision.Facts(step_status=0)
    assert (facts.allowed, facts.lead_s) == (protocol.DEFAULT_MAX_REQUEUES,
                                             protocol.DEFAULT_SIGNAL_LEAD_S)  # fmt: skip
    assert dataclasses.is_dataclass(facts)
    assert set(decision.ACTIONS) == set(protocol.ACTIONS)


def test_the_supervisor_is_the_module_the_template_runs():
    assert Path(PACKAGE.parent, *protocol.SUPERVISOR_MODULE.split("."), "__main__.py").is_file()
    assert Path(PACKAGE.parent, *protocol.DECISION_MODULE.split(".")).with_suffix(".py").is_file()
    script = templating.render(DEFAULT_TEMPLATE, **context(CASES["srun_cpu"]).variables())
    assert f"-m {protocol.SUPERVISOR_MODULE} " in script

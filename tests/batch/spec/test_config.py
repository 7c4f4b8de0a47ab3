"""batch.config: file discovery, layer precedence with sources, profiles, merge rules, errors."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurmddp.batch.spec.config import (
    DEFAULTS,
    ConfigError,
    ConfigFiles,
    Settings,
    load_sources,
    resolve_settings,
)
from slurmddp.batch.spec.profiles import format_profiles, list_profiles
from tests.conftest import ROOT


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home directory of its own, so the real ~/.config never leaks in."""
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def load(cwd: Path, home: Path, **environ: str) -> ConfigFiles:
    return load_sources(cwd, {"HOME": str(home), **environ})


def resolve(cwd: Path, home: Path, cli=None, profile=None, **environ: str) -> Settings:
    return resolve_settings(cli or {}, profile, load(cwd, home, **environ))


def user_file(home: Path, text: str) -> Path:
    return write(home / ".config" / "slurmddp" / "profiles.toml", text)


# --- discovery ---------------------------------------------------------------------------------


def test_project_file_is_found_in_a_parent_directory(tmp_path, home):
    project = write(tmp_path / "proj" / "slurmddp.toml", 'partition = "gpu"\n')
    cwd = tmp_path / "proj" / "src" / "pkg"
    cwd.mkdir(parents=True)
    files = load(cwd, home)
    assert files.project is not None and files.project.path == project
    assert files.searched == (cwd, cwd.parent, cwd.parent.parent)
    s = resolve_settings({}, None, files)
    assert s["partition"] == "gpu"
    assert s.sources["partition"] == f"slurmddp.toml ({project})"


def test_pyproject_tool_table_is_read_and_one_without_it_does_not_stop_the_search(tmp_path, home):
    pyproject = write(tmp_path / "proj" / "pyproject.toml", '[tool.slurmddp]\nqos = "qos_gpu-t3"\n')
    # A sub-package's pyproject.toml without our table is not the project configuration.
    write(tmp_path / "proj" / "sub" / "pyproject.toml", '[project]\nname = "sub"\n')
    s = resolve(tmp_path / "proj" / "sub", home)
    assert s["qos"] == "qos_gpu-t3"
    assert s.sources["qos"] == f"pyproject.toml [tool.slurmddp] ({pyproject})"


def test_slurmddp_toml_wins_over_pyproject_in_the_same_directory_with_a_warning(tmp_path, home):
    own = write(tmp_path / "slurmddp.toml", 'account = "own"\n')
    pyproject = write(tmp_path / "pyproject.toml", '[tool.slurmddp]\naccount = "py"\nqos = 1\n')
    files = load(tmp_path, home)
    s = resolve_settings({}, None, files)
    assert (s["account"], "qos" in s) == ("own", False)
    assert len(files.warnings) == 1
    assert str(pyproject) in files.warnings[0] and str(own) in files.warnings[0]


def test_the_nearest_directory_wins_over_a_parent(tmp_path, home):
    write(tmp_path / "slurmddp.toml", 'account = "parent"\npartition = "p"\n')
    write(tmp_path / "child" / "pyproject.toml", '[tool.slurmddp]\naccount = "child"\n')
    s = resolve(tmp_path / "child", home)
    # Only the nearest file counts: project files do not stack.
    assert s["account"] == "child" and "partition" not in s


def test_upward_search_stops_at_the_filesystem_root(tmp_path, home):
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    files = load(cwd, home)
    chain = (cwd, *cwd.parents)
    assert files.searched == chain[: len(files.searched)]
    if files.project is None:
        assert files.searched[-1] == Path("/")  # nothing above: every ancestor was looked at
    else:  # this machine has a configuration above the temporary directory
        assert files.project.path.parent == files.searched[-1]
        assert tmp_path not in (files.project.path, *files.project.path.parents)


def test_relative_cwd_is_made_absolute(tmp_path, home, monkeypatch):
    write(tmp_path / "slurmddp.toml", 'qos = "q"\n')
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    files = load(Path(".."), home)
    assert files.cwd == tmp_path and files.project is not None


@pytest.mark.parametrize(
    ("xdg", "where"),
    [
        ("xdg", "xdg/slurmddp/profiles.toml"),
        (None, "home/.config/slurmddp/profiles.toml"),
        ("relative/dir", "home/.config/slurmddp/profiles.toml"),  # invalid per XDG: ignored
    ],
)
def test_user_profiles_follow_xdg_config_home(tmp_path, home, xdg, where):
    path = write(tmp_path / where, '[profiles.mine]\npartition = "cpu"\n')
    environ = {"XDG_CONFIG_HOME": str(tmp_path / xdg) if xdg == "xdg" else xdg} if xdg else {}
    files = load(tmp_path, home, **environ)
    user = [f for f in files.files if f.origin == "user"]
    assert [f.path for f in user] == [path]
    s = resolve_settings({}, "mine", files)
    assert s.sources["partition"] == f"profile 'mine' ({path})"


def test_no_home_and_no_xdg_means_no_user_file(tmp_path):
    files = load_sources(tmp_path, {})
    assert [f for f in files.files if f.origin == "user"] == []


def test_centre_file_comes_from_the_environment_variable(tmp_path, home):
    centre = write(tmp_path / "etc" / "centre.toml", '[profiles.jz]\naccount = "abc"\n')
    s = resolve(tmp_path, home, profile="jz", SLURMDDP_PROFILES="etc/centre.toml")
    assert s["account"] == "abc"
    assert s.sources["account"] == f"profile 'jz' ({centre})"


def test_a_missing_centre_file_is_an_error(tmp_path, home):
    with pytest.raises(ConfigError, match=r"\$SLURMDDP_PROFILES='/nope.toml': no such file"):
        load(tmp_path, home, SLURMDDP_PROFILES="/nope.toml")


# --- precedence --------------------------------------------------------------------------------


def test_precedence_across_all_layers_with_sources(tmp_path, home):
    """Each key is set by every layer down to one, so each layer wins exactly one key."""
    centre = write(
        tmp_path / "centre.toml",
        """
        partition = "centre"
        account = "centre"
        qos = "centre"
        constraint = "centre"
        mem = "centre"
        [profiles.gpu]
        partition = "profile"
        account = "profile"
        """,
    )
    user = user_file(
        home,
        """
        partition = "user"
        account = "user"
        qos = "user"
        constraint = "user"
        """,
    )
    project = write(
        tmp_path / "proj" / "slurmddp.toml",
        """
        profile = "gpu"
        partition = "project"
        account = "project"
        qos = "project"
        """,
    )
    s = resolve(tmp_path / "proj", home, cli={"partition": "cli"}, SLURMDDP_PROFILES=str(centre))
    assert {k: s[k] for k in ("partition", "account", "qos", "constraint", "mem", "nodes")} == {
        "partition": "cli",
        "account": "profile",
        "qos": "project",
        "constraint": "user",
        "mem": "centre",
        "nodes": 1,
    }
    assert s.sources["partition"] == "command line"
    assert s.sources["account"] == f"profile 'gpu' ({centre})"
    assert s.sources["qos"] == f"slurmddp.toml ({project})"
    assert s.sources["constraint"] == f"user profiles ({user})"
    assert s.sources["mem"] == f"centre profiles $SLURMDDP_PROFILES ({centre})"
    assert s.sources["nodes"] == "built-in default"
    assert (s["profile"], s.sources["profile"]) == ("gpu", f"slurmddp.toml ({project})")


def test_command_line_profile_beats_the_default_and_empty_means_none(tmp_path, home):
    write(
        tmp_path / "slurmddp.toml",
        """
        profile = "a"
        [profiles.a]
        qos = "a"
        [profiles.b]
        qos = "b"
        """,
    )
    assert resolve(tmp_path, home)["qos"] == "a"
    chosen = resolve(tmp_path, home, profile="b")
    assert (chosen["qos"], chosen.sources["profile"]) == ("b", "command line")
    none = resolve(tmp_path, home, profile="")
    assert "qos" not in none and "profile" not in none


def test_a_more_specific_file_hides_a_profile_of_the_same_name(tmp_path, home):
    centre = write(tmp_path / "c.toml", '[profiles.jz]\nqos = "centre"\nmem = "1G"\n')
    user = user_file(home, '[profiles.jz]\nqos = "user"\n')
    files = load(tmp_path, home, SLURMDDP_PROFILES=str(centre))
    s = resolve_settings({}, "jz", files)
    assert s["qos"] == "user" and "mem" not in s  # hidden whole, not merged
    listed = [(p.name, p.file, p.shadowed_by) for p in list_profiles(files)]
    assert listed == [("jz", user, None), ("jz", centre, user)]


def test_command_line_values_none_are_not_typed_and_text_numbers_are_accepted(tmp_path, home):
    write(tmp_path / "slurmddp.toml", 'qos = "file"\nnodes = 2\n')
    s = resolve(tmp_path, home, cli={"qos": None, "nodes": "4", "time": 90})
    assert (s["qos"], s["nodes"], s["time"]) == ("file", 4, "90")
    assert s.sources["nodes"] == "command line"


def test_defaults_can_be_replaced_by_the_caller(tmp_path):
    s = resolve_settings({}, None, ConfigFiles(tmp_path), defaults={"launcher": "torchrun"})
    assert dict(s) == {"launcher": "torchrun"}
    # The built-in layer is checked like any other: its relative output is the command's.
    expected = {**DEFAULTS, "output": tmp_path / DEFAULTS["output"]}
    assert dict(resolve_settings({}, None, ConfigFiles(tmp_path))) == expected


def test_settings_are_a_read_only_mapping(tmp_path):
    s = resolve_settings({"setup": ["a"], "env": ["X=1"]}, None, ConfigFiles(tmp_path))
    assert isinstance(s["setup"], tuple) and s.get("partition") is None and "nodes" in s
    with pytest.raises(TypeError):
        s.values["nodes"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        s["env"]["Y"] = "2"  # type: ignore[index]
    assert ("env", '{ X = "1" }', "command line") in s.rows()


# --- extends -----------------------------------------------------------------------------------


def test_extends_chain_child_wins_and_sources_name_the_base(tmp_path, home):
    f = write(
        tmp_path / "slurmddp.toml",
        """
        [profiles.base]
        partition = "gpu"
        qos = "slow"
        [profiles.mid]
        extends = "base"
        qos = "fast"
        [profiles.big]
        extends = "mid"
        nodes = 16
        """,
    )
    s = resolve(tmp_path, home, profile="big")
    assert (s["partition"], s["qos"], s["nodes"]) == ("gpu", "fast", 16)
    assert s.sources["partition"] == f"profile 'base' ({f}), extended by 'mid'"
    assert s.sources["qos"] == f"profile 'mid' ({f}), extended by 'big'"
    assert s.sources["nodes"] == f"profile 'big' ({f})"


def test_extending_its_own_name_refines_the_less_specific_definition(tmp_path, home):
    centre = write(tmp_path / "c.toml", '[profiles.jz]\npartition = "gpu_p13"\nqos = "t3"\n')
    user = user_file(home, '[profiles.jz]\nextends = "jz"\nqos = "t4"\n')
    s = resolve(tmp_path, home, profile="jz", SLURMDDP_PROFILES=str(centre))
    assert (s["partition"], s["qos"]) == ("gpu_p13", "t4")
    assert s.sources["partition"] == f"profile 'jz' ({centre}), extended by 'jz'"
    assert s.sources["qos"] == f"profile 'jz' ({user})"


def test_a_centre_profile_cannot_extend_a_more_specific_one(tmp_path, home):
    centre = write(tmp_path / "c.toml", '[profiles.jz]\nextends = "mine"\n')
    write(tmp_path / "slurmddp.toml", '[profiles.mine]\nqos = "q"\n')
    with pytest.raises(ConfigError) as e:
        resolve(tmp_path, home, profile="jz", SLURMDDP_PROFILES=str(centre))
    assert str(e.value).startswith(f"unknown profile 'mine' (extended by 'jz' in {centre})")


@pytest.mark.parametrize(
    ("tables", "cycle"),
    [
        ({"a": "b", "b": "a"}, "'a' ({f}) extends 'b' ({f}) extends 'a'"),
        (
            {"a": "b", "b": "c", "c": "b"},
            "'a' ({f}) extends 'b' ({f}) extends 'c' ({f}) extends 'b'",
        ),
    ],
)
def test_extends_cycles_are_errors(tmp_path, home, tables, cycle):
    text = "".join(f'[profiles.{n}]\nextends = "{base}"\n' for n, base in tables.items())
    f = write(tmp_path / "slurmddp.toml", text)
    with pytest.raises(ConfigError) as e:
        resolve(tmp_path, home, profile="a")
    assert str(e.value) == f"profile cycle: {cycle.format(f=f)}; remove one 'extends'"


def test_a_profile_extending_its_own_name_with_nothing_below_is_unknown(tmp_path, home):
    f = write(tmp_path / "slurmddp.toml", '[profiles.a]\nextends = "a"\n')
    with pytest.raises(ConfigError, match=rf"unknown profile 'a' \(extended by 'a' in {f}, which"):
        resolve(tmp_path, home, profile="a")


# --- merge rules -------------------------------------------------------------------------------


def test_env_tables_merge_key_by_key(tmp_path, home):
    centre = write(
        tmp_path / "c.toml",
        """
        env = { A = "centre", B = "centre", C = "centre" }
        [profiles.p]
        env = { B = "profile", OMP_NUM_THREADS = 8 }
        """,
    )
    project = write(tmp_path / "slurmddp.toml", 'env = { A = "project", C = "project" }\n')
    s = resolve(
        tmp_path, home, cli={"env": ["C=cli", "D=x=y"]}, profile="p", SLURMDDP_PROFILES=str(centre)
    )
    assert dict(s["env"]) == {
        "A": "project",
        "B": "profile",
        "C": "cli",
        "OMP_NUM_THREADS": "8",
        "D": "x=y",
    }
    assert s.sources["env"] == (
        f"centre profiles $SLURMDDP_PROFILES ({centre}) + slurmddp.toml ({project}) + "
        f"profile 'p' ({centre}) + command line"
    )


def test_lists_are_appended_from_the_machine_to_the_submission(tmp_path, home):
    centre = write(
        tmp_path / "c.toml",
        """
        setup = ["centre"]
        [profiles.base]
        setup = ["module load cuda"]
        sbatch_args = ["--exclusive"]
        [profiles.p]
        extends = "base"
        setup = ["module load pytorch"]
        """,
    )
    user_file(home, 'setup = ["user"]\n')
    write(tmp_path / "slurmddp.toml", 'setup = ["source .venv/bin/activate"]\nsrun_args = []\n')
    cli = {"setup": ["echo cli"], "sbatch_args": ["--exclusive=user"], "srun_args": ["-l"]}
    s = resolve(tmp_path, home, cli=cli, profile="p", SLURMDDP_PROFILES=str(centre))
    # Module loads run before the project's venv activation, the command line's lines last.
    assert s["setup"] == (
        "centre",
        "user",
        "module load cuda",
        "module load pytorch",
        "source .venv/bin/activate",
        "echo cli",
    )
    assert s["sbatch_args"] == ("--exclusive", "--exclusive=user")  # sbatch keeps the last one
    assert s["srun_args"] == ("-l",)
    assert s.sources["sbatch_args"] == f"profile 'base' ({centre}), extended by 'p' + command line"


# --- paths -------------------------------------------------------------------------------------


def test_paths_are_relative_to_their_file_and_tilde_means_home(tmp_path, home):
    write(
        tmp_path / "proj" / "slurmddp.toml",
        """
        template = "jobs/train.sh.j2"
        output = "~/logs"
        [profiles.venv]
        python = ".venv/bin/python"
        [profiles.bare]
        python = "python3"
        [profiles.image]
        container = "images/torch.sif"
        [profiles.registry]
        container = "docker://nvcr.io/nvidia/pytorch:24.05-py3"
        """,
    )
    cwd = tmp_path / "proj" / "src"
    cwd.mkdir()
    s = resolve(cwd, home, profile="venv")
    assert s["template"] == tmp_path / "proj" / "jobs" / "train.sh.j2"
    assert s["output"] == home / "logs"
    assert s["python"] == str(tmp_path / "proj" / ".venv" / "bin" / "python")
    assert resolve(cwd, home, profile="bare")["python"] == "python3"  # looked up on PATH
    assert resolve(cwd, home, profile="image")["container"] == str(tmp_path / "proj" / "images" /
                                                                   "torch.sif")  # fmt: skip
    assert resolve(cwd, home, profile="registry")["container"] == (
        "docker://nvcr.io/nvidia/pytorch:24.05-py3")
    assert resolve(cwd, home, cli={"output": "../out"})["output"] == tmp_path / "proj" / "out"


# --- errors ------------------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest_and_lists_the_known_ones(tmp_path, home):
    f = write(tmp_path / "slurmddp.toml", 'partiton = "gpu"\n')
    with pytest.raises(ConfigError) as e:
        load(tmp_path, home)
    message = str(e.value)
    assert message.startswith(f"{f}: unknown key 'partiton'; did you mean 'partition'? known: ")
    assert "account, backend," in message and "\n" not in message


def test_unknown_key_in_a_profile_names_its_table(tmp_path, home):
    f = write(tmp_path / "pyproject.toml", "[tool.slurmddp.profiles.jz]\ngpus = 4\n")
    with pytest.raises(ConfigError) as e:
        load(tmp_path, home)
    assert str(e.value).startswith(
        f"{f}: [tool.slurmddp.profiles.jz]: unknown key 'gpus'; did you mean 'gpus_per_node'? "
    )


def test_unknown_command_line_option_is_named(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^command line: unknown key 'node'; did you mean 'nodes'"
    ):
        resolve_settings({"node": 2}, None, ConfigFiles(tmp_path))


def test_unknown_profile_lists_the_available_ones(tmp_path, home):
    f = write(tmp_path / "slurmddp.toml", "[profiles.jeanzay]\n[profiles.local]\n")
    with pytest.raises(ConfigError) as e:
        resolve(tmp_path, home, profile="jeanzy")
    assert str(e.value) == (
        "unknown profile 'jeanzy' (named on the command line); did you mean 'jeanzay'? "
        "available: jeanzay, local"
    )
    write(f, 'profile = "gone"\n')
    with pytest.raises(ConfigError) as e:
        resolve(tmp_path, home)
    assert str(e.value).startswith(
        f"unknown profile 'gone' (named as the default by slurmddp.toml ({f})): "
        "no profile is defined; add [profiles.gone] to slurmddp.toml, "
    )


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('nodes = "2"', 'nodes = "2" must be an integer >= 1'),
        ("nodes = 0", "nodes = 0 must be an integer >= 1"),
        ("gpus_per_node = true", "gpus_per_node = true must be an integer >= 0"),
        ('setup = "module load x"', 'setup = "module load x" must be a list of strings'),
        ("sbatch_args = [1]", "sbatch_args = [1] must be a list of strings (quote every item)"),
        ('launcher = "mpiexec"', 'launcher = "mpiexec" must be one of srun, torchrun, mpirun'),
        ('backend = "ncl"', 'backend = "ncl" must be one of auto, nccl, gloo, mpi'),
        ("time = [1]", "time = [1] must be a Slurm value such as"),
        ("mem = -1", 'mem = -1 must be a Slurm value such as "64G" or "02:00:00", or an integer'),
        ('signal = "USR1@60"', 'signal = "USR1@60" must be the signal alone, e.g. \'USR1\' and '
         'the lead time as signal_lead (--signal-lead 60)'),
        ('signal = "HUP"', 'signal = "HUP" cannot warn the ranks: srun answers it by killing'),
        ("signal = 12", "signal = 12 must be USR2 or USR1"),
        ('partition = ""', 'partition = "" must be a non-empty string'),
        ("env = { X = 1.5 }", "env = { X = 1.5 } must be a table of strings, and X = 1.5 is not"),
        ('env = { "a-b" = "1" }', 'env = { a-b = "1" } must be a table of variables, and'),
        ("profile = 3", "profile = 3 must be a profile name"),
        ("profiles = 3", "profiles must be a table of [profiles.NAME] tables"),
        ("[profiles]\njz = 3", "profiles.jz must be a table, not a value"),
        ('[profiles.jz]\nextends = ""', 'profiles.jz.extends = "" must be a profile name'),
        ("[profiles.jz]\nmax_requeues = -1", "profiles.jz.max_requeues = -1 must be an integer"),
    ],
)
def test_wrong_types_name_the_file_key_value_and_expectation(tmp_path, home, toml, message):
    f = write(tmp_path / "slurmddp.toml", toml + "\n")
    with pytest.raises(ConfigError) as e:
        load(tmp_path, home)
    assert str(e.value).startswith(f"{f}: {message}")


def test_wrong_command_line_type_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match=r"^command line: --cpus-per-task = \"many\" must be"):
        resolve_settings({"cpus_per_task": "many"}, None, ConfigFiles(tmp_path))
    with pytest.raises(ConfigError, match=r"--env = \[\"NOEQUALS\"\] must be NAME=VALUE"):
        resolve_settings({"env": ["NOEQUALS"]}, None, ConfigFiles(tmp_path))


def test_toml_syntax_error_names_the_file_and_line(tmp_path, home):
    f = write(tmp_path / "c.toml", '[profiles.jz]\npartition = "gpu"\nqos = \n')
    with pytest.raises(ConfigError) as e:
        load(tmp_path, home, SLURMDDP_PROFILES=str(f))
    assert str(e.value).startswith(f"{f}: invalid TOML: ")
    assert "line 3" in str(e.value)


# --- listing -----------------------------------------------------------------------------------


def test_format_profiles_lists_profiles_and_where_each_value_came_from(tmp_path, home):
    centre = write(tmp_path / "c.toml", '[profiles.jz]\npartition = "gpu"\nsetup = ["m"]\n')
    user = user_file(home, '[profiles.jz]\nextends = "jz"\nenv = { A = "1" }\n')
    files = load(tmp_path, home, SLURMDDP_PROFILES=str(centre))
    profiles = list_profiles(files)
    assert [p.keys for p in profiles] == [("env",), ("partition", "setup")]
    text = format_profiles(profiles, resolve_settings({"nodes": 2}, "jz", files))
    assert text.splitlines()[:6] == [
        f"jz  {user}",
        '  extends = "jz"',
        '  env = { A = "1" }',
        f"jz  {centre}  (hidden by {user})",
        '  partition = "gpu"',
        '  setup = ["m"]',
    ]
    assert "settings with profile 'jz':" in text
    rows = {line.split()[0]: line for line in text.splitlines()[8:]}
    assert rows["partition"].endswith(f"profile 'jz' ({centre}), extended by 'jz'")
    assert rows["nodes"].split()[1:] == ["2", "command", "line"]


def test_format_profiles_without_any_says_where_to_put_them(tmp_path):
    assert format_profiles(list_profiles(ConfigFiles(tmp_path))).startswith("no profiles: add")


# --- Python 3.10 -------------------------------------------------------------------------------


def test_module_is_python_310_syntax_and_guards_tomllib():
    source = (ROOT / "slurmddp" / "batch" / "spec" / "config.py").read_text(encoding="utf-8")
    tree = ast.parse(source, feature_version=(3, 10))
    guarded = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and "sys.version_info >= (3, 11)" in ast.unparse(node.test)
    )
    assert ast.unparse(guarded.body[0]) == "import tomllib"
    assert ast.unparse(guarded.orelse[0]) == "import tomli as tomllib"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert "tomli>=2; python_version < '3.11'" in pyproject


def test_module_works_with_tomli_when_tomllib_is_absent(tmp_path):
    """Python 3.10 in miniature: no tomllib module, tomli in its place (same API)."""
    program = textwrap.dedent(
        """
        import sys, types
        try:
            import tomllib as real
        except ModuleNotFoundError:  # a real 3.10 runs this test too
            import tomli as real
        tomli = types.ModuleType("tomli")
        tomli.loads, tomli.TOMLDecodeError = real.loads, real.TOMLDecodeError
        sys.modules["tomli"] = tomli
        sys.modules["tomllib"] = None  # import tomllib now raises ImportError
        sys.version_info = (3, 10, 13, "final", 0)
        from pathlib import Path
        from slurmddp.batch.spec import config
        assert config.tomllib is tomli
        files = config.load_sources(Path(sys.argv[1]), {})
        print(config.resolve_settings({}, None, files)["qos"])
        """
    )
    write(tmp_path / "slurmddp.toml", 'qos = "q310"\n')
    done = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)], capture_output=True, text=True
    )
    assert (done.returncode, done.stdout.strip()) == (0, "q310"), done.stderr

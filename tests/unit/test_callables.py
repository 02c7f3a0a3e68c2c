"""A reward function in the user's own file: `module:function` beside the working directory, or a file path
(`./myrewards.py:fn`, `rewards/score.py:fn`), found when the config loads and imported when the run needs it."""

import sys

import pytest

from rlfuse.config import load_config
from rlfuse.config.callables import check_callable, load_callable
from rlfuse.errors import ConfigError

REWARDS = "def enthusiasm(prompts, completions, **_):\n    return [c.count('!') for c in completions]\n"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory holding myrewards.py, as a user's project folder, and not on sys.path."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "myrewards", raising=False)
    return tmp_path


def test_a_module_beside_the_working_directory_loads_without_pythonpath(workdir):
    cfg = load_config(None, ["rl.reward=myrewards:enthusiasm", "rl.algo=grpo", "rl.k=2"])
    # kept as the file's path: a Ray worker or a resumed run finds it anywhere, and the working directory never goes
    # in front of the installed packages (a json.py there would shadow json)
    assert cfg.rl.reward == f"{workdir / 'myrewards.py'}:enthusiasm"
    fn = load_callable(cfg.rl.reward, "rl.reward")
    assert fn(["p"], ["wow!!"]) == [2]
    assert sys.path[0] != str(workdir) and "" not in sys.path


def test_a_package_beside_the_working_directory_imports_after_the_installed_ones(workdir, monkeypatch):
    (workdir / "mypkg").mkdir()
    (workdir / "mypkg" / "__init__.py").write_text("")
    (workdir / "mypkg" / "score.py").write_text("import json\n\ndef f(prompts, completions, **_):\n"
                                                "    return [float(len(json.dumps(c))) for c in completions]\n")
    (workdir / "json.py").write_text("raise ImportError('the working directory shadowed json')\n")
    monkeypatch.delitem(sys.modules, "mypkg", raising=False)
    monkeypatch.delitem(sys.modules, "mypkg.score", raising=False)
    spec = check_callable("mypkg.score:f", "rl.reward")
    assert spec == "mypkg.score:f"
    assert load_callable(spec, "rl.reward")(["p"], ["ab"]) == [4.0]
    assert sys.path[-1] == str(workdir)


@pytest.mark.parametrize("given", ["./myrewards.py:enthusiasm", "myrewards.py:enthusiasm"])
def test_a_file_path_loads_and_is_kept_absolute(workdir, given):
    cfg = load_config(None, [f"rl.reward={given}", "rl.algo=grpo", "rl.k=2"])
    assert cfg.rl.reward == f"{workdir / 'myrewards.py'}:enthusiasm"  # a resumed run or a Ray worker finds it anywhere
    fn = load_callable(cfg.rl.reward, "rl.reward")
    assert fn(["p"], ["a!"]) == [1]
    assert load_callable(cfg.rl.reward, "rl.reward") is fn  # imported once per process


def test_two_files_of_the_same_name_stay_apart(workdir):
    (workdir / "other").mkdir()
    (workdir / "other" / "myrewards.py").write_text("def enthusiasm(prompts, completions, **_):\n    return [7.0]\n")
    a = load_callable(check_callable("myrewards.py:enthusiasm", "rl.reward"), "rl.reward")
    b = load_callable(check_callable("other/myrewards.py:enthusiasm", "rl.reward"), "rl.reward")
    assert a(["p"], ["!"]) == [1] and b(["p"], ["!"]) == [7.0]


def test_a_file_imports_its_neighbours(workdir):
    (workdir / "lib").mkdir()
    (workdir / "lib" / "rwhelpers_k3.py").write_text("BONUS = 5\n")
    (workdir / "lib" / "score.py").write_text("import rwhelpers_k3\n\ndef f(prompts, completions, **_):\n"
                                              "    return [rwhelpers_k3.BONUS] * len(completions)\n")
    assert load_callable(check_callable("lib/score.py:f", "rl.reward"), "rl.reward")(["p"], ["c"]) == [5]


@pytest.mark.parametrize("given, says", [
    ("nowhere:enthusiasm", r"no module 'nowhere': not importable, and no nowhere.py in the working directory .*"
                           r"give its path \(rl.reward=path/to/nowhere.py:enthusiasm\)"),
    ("./missing.py:enthusiasm", r"file ./missing.py not found \(looked in .*\); give the path of a .py file"),
    ("myrewards", r"'myrewards' is not module:function or path/to/file.py:function"),
    (":enthusiasm", r"is not module:function"),
])
def test_what_cannot_be_found_is_said_when_the_config_loads(workdir, given, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, [f"rl.reward={given}", "rl.algo=grpo", "rl.k=2"])


def test_what_fails_on_import_names_the_file_and_the_function(workdir):
    (workdir / "broken.py").write_text("import not_a_package_anywhere\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py raised ModuleNotFoundError: No module named "
                                          r"'not_a_package_anywhere'"):
        load_callable(check_callable("broken.py:f", "rl.reward"), "rl.reward")
    with pytest.raises(ConfigError, match=r"myrewards has no 'enthusiasmm'; name one of its functions \(enthusiasm\)"):
        load_callable("myrewards:enthusiasmm", "rl.reward")
    (workdir / "consts.py").write_text("SCORE = 3\n")
    with pytest.raises(ConfigError, match="consts.py:SCORE is a int, not a function"):
        load_callable(check_callable("consts.py:SCORE", "rl.reward"), "rl.reward")

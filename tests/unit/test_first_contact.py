"""What a new user meets first: TRL's setting names answered with rlfuse's, each algorithm's own defaults, the
embedded toy model refused on the user's own data, a Ray placement refused without Ray, the single process ranked by
`rlfuse plan`, the run folder said first and not left behind by a run that wrote nothing, held-out sizes said."""

import re
import sys

import pytest

from rlfuse import api
from rlfuse.cli import main
from rlfuse.config import load_config
from rlfuse.config.trl_names import TRL_NAMES
from rlfuse.errors import ConfigError
from rlfuse.evaluation import eval_table

from conftest import ROOT


@pytest.mark.parametrize("given, field", [
    ("rl.beta=0.04", "rl.kl_coef=0.04"), ("rl.learning_rate=1e-5", "rl.lr=1e-5"),
    ("rl.max_completion_length=64", "rl.max_new_tokens=64"), ("rl.num_generations=8", "rl.k=8"),
    ("rl.num_iterations=2", "rl.epochs=2"),  # not rl.iterations, which difflib would suggest
    ("sft.learning_rate=2e-5", "sft.lr=2e-5"), ("rl.seed=3", "run.seed=3"), ("rl.output_dir=x", "run.dir=x"),
])
def test_a_trl_name_is_answered_with_the_rlfuse_field(given, field):
    with pytest.raises(ConfigError, match=re.escape(f"{given.split('=')[0]}: TRL's name; rlfuse calls it "
                                                    f"{field.split('=')[0]}") + r".*" + re.escape(f"set {field} instead")):
        load_config(None, [given])


@pytest.mark.parametrize("given, fix", [
    ("run.bf16=true", "set run.precision instead"), ("rl.bf16=true", "set run.precision instead"),  # not run.precision=True
    ("rl.gradient_accumulation_steps=4", "set rl.mini_batch_size instead"),  # micro-batches, not completions
    ("model.load_in_4bit=true", "set model.quantization instead"),
])
def test_a_trl_value_is_not_echoed_where_the_two_differ_in_kind(given, fix):
    with pytest.raises(ConfigError, match=re.escape(fix)):
        load_config(None, [given])


def test_trl_names_without_an_equivalent_and_trl_sections_say_so():
    with pytest.raises(ConfigError, match="rl.warmup_steps: TRL's warmup_steps has no rlfuse equivalent"):
        load_config(None, ["rl.warmup_steps=10"])
    with pytest.raises(ConfigError, match="rl.epsilon_high: .*set rl.clip_high=0.28 instead"):
        load_config(None, ["rl.epsilon_high=0.28"])
    with pytest.raises(ConfigError, match="rl.use_vllm: .*rollout.engine"):
        load_config(None, ["rl.use_vllm=true"])
    with pytest.raises(ConfigError, match="grpo: no section 'grpo': TRL's settings for it live in rlfuse's rl"):
        load_config(None, ["grpo.beta=0.1"])


def test_the_trl_table_and_docs_from_trl_agree():
    """Each mapping the code answers with is a row of docs/from_trl.md, in the table of its TRL config."""
    doc = (ROOT / "docs" / "from_trl.md").read_text()
    rows = {}  # (section, TRL name) -> rlfuse fields named in the row
    section = None
    for line in doc.splitlines():
        heading = re.match(r"## .*-> `(\w+)\.\*`", line)
        if heading:
            section = heading.group(1)
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if section and len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[(section, name)] = set(re.findall(r"`(\w+\.\w+)`", cells[2])) | {cells[2]}
    for section, names in TRL_NAMES.items():
        for name, entry in names.items():
            assert (section, name) in rows, f"{section}.{name} is not in docs/from_trl.md's {section} table"
            named = rows[(section, name)]
            assert (entry.field in named) if entry.field else "no equivalent" in " ".join(named), (section, name, named)


def test_each_algorithm_brings_its_own_defaults_unless_set():
    ppo, grpo, rloo = (load_config(None, [f"rl.algo={a}"]).rl for a in ("ppo", "grpo", "rloo"))
    assert (ppo.k, ppo.prompts_per_iter, ppo.kl_coef, ppo.kl_target) == (1, 32, 0.2, 4.0)
    assert (grpo.k, grpo.prompts_per_iter, grpo.kl_coef, grpo.kl_target) == (4, 8, 0.2, None)  # no controller, as TRL
    assert (rloo.k, rloo.kl_coef, rloo.kl_target) == (4, 0.1, None)
    mine = load_config(None, ["rl.algo=grpo", "rl.k=8", "rl.kl_target=2"]).rl
    assert (mine.k, mine.prompts_per_iter, mine.kl_target) == (8, 8, 2.0)  # what is given stays
    shipped = load_config(ROOT / "configs" / "default.yaml", ["rl.algo=grpo"]).rl
    assert shipped.k == 4  # the shipped default config leaves them to the algorithm too
    assert load_config(ROOT / "configs" / "smollm2_math.yaml").rl.kl_coef == 0.1  # a config's own values win
    # a Config object switched to another algorithm takes its defaults where it held the previous one's
    switched = api.load_config(api.load_config(None), {"rl.algo": "grpo", "rl.prompts_per_iter": 32}).rl
    assert (switched.k, switched.prompts_per_iter, switched.kl_coef, switched.kl_target) == (4, 32, 0.2, None)
    back = api.load_config(api.load_config(None, {"rl.algo": "grpo", "rl.k": 8}), {"rl.algo": "ppo"}).rl
    assert (back.k, back.prompts_per_iter, back.kl_target) == (8, 32, 4.0)  # k was set: it stays


def test_a_ray_placement_without_ray_is_refused_when_the_config_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # hidden, as if not installed
    with pytest.raises(ConfigError, match=r"placement.strategy: placement.strategy=flattened runs on Ray workers, "
                                          r"and Ray is not installed; install it \(bash scripts/install.sh ray"):
        load_config(None, ["placement.strategy=flattened"])
    assert load_config(None, ["placement.strategy=single"]).placement.strategy == "single"


def test_plan_ranks_the_single_process_beside_the_ray_layouts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--workers", "2", "--out", str(tmp_path / "plan.yaml")]) == 0
    table = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ") and l[2].isdigit()]
    strategies = {l.split("|")[2].strip().split(",")[0] for l in table}
    assert "single" in strategies and "flattened" in strategies


def test_own_data_with_the_toy_model_is_refused_and_leaves_no_folder(tmp_path, capsys):
    data = tmp_path / "mine.csv"
    data.write_text("text\n" + "".join(f"review {i} was fine\n" for i in range(40)))
    run_dir = tmp_path / "run"
    assert main(["sft", "data.kind=csv", f"data.path={data}", f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"[sft] run folder: {run_dir}"  # said first
    assert "config error: model.name: data.kind=csv is your own data, and model.name is the embedded task's toy" in err
    assert not run_dir.exists()  # nothing was written: nothing is left to --overwrite


def test_a_failed_run_into_a_new_default_folder_leaves_no_husk(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["rl"]) == 2  # no SFT model in a new folder
    assert "rl.sft_path" in capsys.readouterr().err
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_folder_with_an_earlier_run_is_kept_when_a_run_fails(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "sft" / "model").mkdir(parents=True)
    (run_dir / "sft" / "model" / "config.json").write_text("{}")
    with pytest.raises(ConfigError):
        api.train_rl(run_dir=run_dir, overrides={"rl.algo": "grpo", "rl.k": 1})
    assert (run_dir / "sft" / "model" / "config.json").is_file()


def test_the_before_after_table_says_how_many_prompts_it_averages():
    table = eval_table({"before": {"reward_mean": 0.1, "n": 1}, "after": {"reward_mean": 0.4, "n": 1}})
    assert "(1 held-out prompts; few: differences under ~2.0 std are noise)" in table.splitlines()[0]
    assert "(128 held-out prompts)" in eval_table({"before": {"n": 128}, "after": {"n": 128}})


def test_a_small_held_out_split_is_warned_about(tmp_path):
    from rlfuse.data.stages import rl_prompt_rows

    data = tmp_path / "p.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}"}}\n' for i in range(20)))
    said = []
    cfg = load_config(None, ["data.kind=jsonl", f"data.path={data}"])
    train, held = rl_prompt_rows(cfg, None, said.append)
    assert (len(train), len(held)) == (19, 1)
    assert any("warning" in s and "1 of 20 prompts held out" in s for s in said), said


def test_a_path_part_too_long_for_the_file_system_is_one_line(tmp_path, capsys):
    long = tmp_path / ("a" * 300)
    with pytest.raises(ConfigError, match=r"run.dir: a part of the path is 300 bytes long, over the 255"):
        load_config(None, [f"run.dir={long}"])
    for args in (["rl", "--resume", str(long)], ["report", str(long)], ["generate", str(long), "--prompt", "hi"]):
        assert main(args) in (1, 2)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "File name too long" in err[0] and "Traceback" not in err[0], err

"""The placement layer is pure: strategies give their documented layouts, every checker rule fires on a crafted bad
spec (and stays quiet on good ones), the config round-trips to a spec, and nothing here imports torch or Ray."""

import subprocess
import sys

import pytest

from conftest import ROOT
from rlfuse.config import load_config, save_config
from rlfuse.errors import ConfigError, UserError
from rlfuse.plan.roles import Role, Roles, derive_roles
from rlfuse.plan.check import PlacementError, check_placement, validate_placement
from rlfuse.plan.resolve import resolve
from rlfuse.plan.spec import ClusterResources, NodeResources, PlacementSpec, WorkerGroup, WorkerResources
from rlfuse.plan.strategies import flattened, interleaved, separated, single, spec_from_config

PPO = []  # PPO, critic from the reward model: five roles, nothing shared
GRPO_LORA = ["rl.algo=grpo", "rl.k=4", "model.lora=true"]  # the reference is the actor with adapters off
PPO_SHARED = ["model.lora=true", "rl.critic_init=actor"]  # reference and critic both on the actor's body
ALL = "actor generator reference critic reward"


def roles_of(overrides):
    return derive_roles(load_config(None, overrides))


def layout(spec):
    return [(g.name, g.workers, " ".join(g.roles)) for g in spec.groups]


# ------------------------------------------------------------------------------------------ strategies

LAYOUTS = [
    # (config, strategy, workers) -> [(group, workers, roles)]
    (PPO, flattened, 2, [("all", 2, ALL)]),
    (PPO, flattened, 4, [("all", 4, ALL)]),
    (GRPO_LORA, flattened, 4, [("all", 4, "actor generator reference reward")]),
    (PPO, interleaved, 2, [("train", 1, "actor generator critic"), ("score", 1, "reference reward")]),
    (PPO, interleaved, 4, [("train", 3, "actor generator critic"), ("score", 1, "reference reward")]),
    (PPO, interleaved, 8, [("train", 6, "actor generator critic"), ("score", 2, "reference reward")]),
    (GRPO_LORA, interleaved, 2, [("train", 1, "actor generator reference"), ("score", 1, "reward")]),
    (GRPO_LORA, interleaved, 4, [("train", 3, "actor generator reference"), ("score", 1, "reward")]),
    (PPO_SHARED, interleaved, 4, [("train", 3, "actor generator reference critic"), ("score", 1, "reward")]),
    (PPO, separated, 2, [("train", 1, "actor reference critic reward"), ("generate", 1, "generator")]),
    (PPO, separated, 3, [("train", 2, "actor reference critic reward"), ("generate", 1, "generator")]),
    (PPO, separated, 4, [("train", 2, "actor reference critic reward"), ("generate", 2, "generator")]),
    (GRPO_LORA, separated, 2, [("train", 1, "actor reference reward"), ("generate", 1, "generator")]),
    (GRPO_LORA, separated, 4, [("train", 2, "actor reference reward"), ("generate", 2, "generator")]),
]


@pytest.mark.parametrize("overrides,make,workers,expected", LAYOUTS,
                         ids=[f"{m.__name__}-{w}-{'+'.join(o) or 'ppo'}" for o, m, w, _ in LAYOUTS])
def test_strategy_layouts(overrides, make, workers, expected):
    spec = make(roles_of(overrides), workers)
    assert spec.strategy == make.__name__ and spec.uses_ray
    assert layout(spec) == expected
    assert spec.workers == workers


@pytest.mark.parametrize("overrides", [PPO, GRPO_LORA, PPO_SHARED, ["rl.reward=rlfuse.data.gold:gold_reward"]])
@pytest.mark.parametrize("make", [flattened, interleaved, separated])
def test_every_strategy_layout_passes_the_checker(overrides, make):
    roles = roles_of(overrides)
    for workers in range(2, 9):
        spec = make(roles, workers, WorkerResources(cpus=2, gpus=1))  # a GPU per training rank (NCCL)
        assert check_placement(spec, roles, ClusterResources.one_node(2 * workers, workers)) == []
        assert spec.cpus == 2 * workers and spec.gpus == workers


def test_explicit_splits_and_their_bounds():
    roles = roles_of(PPO)
    assert layout(interleaved(roles, 4, score_workers=2))[1] == ("score", 2, "reference reward")
    assert layout(separated(roles, 5, generate_workers=4))[1] == ("generate", 4, "generator")
    for bad in (0, 4):
        with pytest.raises(UserError, match="pick 1..3"):
            interleaved(roles, 4, score_workers=bad)
    with pytest.raises(UserError, match="at least 2 workers"):
        separated(roles, 1)
    with pytest.raises(UserError, match="at least 1 workers"):
        flattened(roles, 0)


def test_strategies_refuse_to_split_shared_weights():
    # reference and reward both on the actor's body: interleaved has nothing it may move
    glued = Roles((Role("actor", True, "sft"), Role("generator", False, "actor"),
                   Role("reference", False, "sft", "actor"), Role("reward", False, "sft", "actor")))
    with pytest.raises(UserError, match="nothing to interleave"):
        interleaved(glued, 2)
    # a generator that is the actor itself (no separate copy) cannot be separated
    fused = Roles((Role("actor", True, "sft"), Role("generator", False, "actor", "actor"), Role("reward", False, "rm")))
    with pytest.raises(UserError, match="generator shares a process"):
        separated(fused, 2)


def test_single_is_one_process_without_ray():
    spec = single(roles_of(PPO))
    assert not spec.uses_ray and layout(spec) == [("main", 1, ALL)]
    # the cluster is not consulted: the driver's own process needs no Ray resources
    assert check_placement(spec, roles_of(PPO), ClusterResources.one_node(0)) == []


def test_spec_queries_and_description():
    spec = separated(roles_of(PPO), 4, address="ray://head:10001")
    assert spec.worker_ranks("train") == range(0, 2) and spec.worker_ranks("generate") == range(2, 4)
    assert spec.groups_of("generator") == ("generate",) and spec.group("train").workers == 2
    assert spec.roles == ("actor", "reference", "critic", "reward", "generator")
    text = spec.describe()
    assert "separated, 4 worker(s) on Ray at ray://head:10001" in text
    assert "generate  workers 2..3  (2 x 1 CPU, 0 GPU)  generator" in text


# ---------------------------------------------------------------------------------------------- checker

GOOD = PlacementSpec("custom", (WorkerGroup("train", 2, ("actor", "critic", "reference")),
                                WorkerGroup("gen", 1, ("generator", "reward"))))


def g(name, workers, roles, cpus=1.0, gpus=0.0):
    return WorkerGroup(name, workers, tuple(roles.split()), cpus, gpus)


def test_a_good_custom_spec_passes_every_rule():
    roles = roles_of(PPO)
    assert check_placement(GOOD, roles, ClusterResources.one_node(3), lambda grp, spec: 2**30, 2**30) == []
    assert validate_placement(GOOD, roles, ClusterResources.one_node(3)) is GOOD


# overrides, groups -> substrings of the one expected problem (what is wrong, where, and the fix)
RULES = [
    (PPO, [g("train", 2, "actor critic reference"), g("train", 1, "generator reward")],
     ["group 'train'", "used twice", "its own name"]),
    (PPO, [g("train", 0, "actor critic reference"), g("gen", 1, "generator reward")],
     ["group 'train'", "at least 1 worker", "set its workers"]),
    (PPO, [g("train", 2, "actor critic reference", cpus=0), g("gen", 1, "generator reward")],
     ["group 'train'", "cpus_per_worker must be > 0", "set it to 1"]),
    (PPO, [g("train", 2, "actor critic reference", gpus=1.5), g("gen", 1, "generator reward")],
     ["group 'train'", "gpus_per_worker=1.5", "0.5, 1 or 2"]),
    (PPO, [g("train", 2, "actor critic reference generator reward"), g("idle", 1, "")],
     ["group 'idle'", "runs no role", "remove it"]),
    (PPO, [g("train", 2, "actor critic reference critic"), g("gen", 1, "generator reward")],
     ["group 'train'", "lists role 'critic' twice", "list it once"]),
    (PPO, [g("train", 2, "actor critic reference"), g("gen", 1, "generator rewrad reward")],
     ["group 'gen'", "unknown role 'rewrad'", "did you mean reward?"]),
    (PPO, [g("train", 2, "actor critic reference"), g("gen", 1, "generator")],
     ["role 'reward' has no group", "add it"]),
    (GRPO_LORA, [g("train", 2, "actor critic reference"), g("gen", 1, "generator reward")],
     ["role 'critic'", "train", "only rl.algo=ppo has a critic", "remove it"]),
    (PPO, [g("train", 2, "actor critic reference"), g("gen", 1, "generator reward critic")],
     ["role 'critic' trains", "train, gen", "keep it in one"]),
    (GRPO_LORA, [g("train", 2, "actor generator"), g("score", 1, "reference reward")],
     ["role 'reference' must share actor's process", "adapters off", "put reference in train only"]),
    (PPO_SHARED, [g("train", 2, "actor reference generator"), g("value", 1, "critic reward")],
     ["role 'critic' must share actor's process", "value head on the actor's body", "put critic in train only"]),
    (PPO, [g("train", 2, "actor reference"), g("gen", 1, "generator reward critic")],
     ["role 'critic' trains with the actor", "is in gen while actor is in train", "put critic in train"]),
    (PPO, [g("train", 2, "actor critic reference", gpus=0.5), g("gen", 1, "generator reward")],
     ["group 'train' trains data-parallel on 2 workers sharing GPUs", "set its gpus_per_worker to 1"]),
]


@pytest.mark.parametrize("overrides,groups,expected", RULES, ids=[r[2][1] for r in RULES])
def test_each_rule_fires_alone_with_its_fix(overrides, groups, expected):
    problems = check_placement(PlacementSpec("custom", tuple(groups)), roles_of(overrides))
    assert len(problems) == 1, problems
    for part in expected:
        assert part in problems[0], (part, problems[0])
    assert "\n" not in problems[0]


ONE_GPU_EACH = PlacementSpec("custom", (g("train", 2, "actor critic reference", gpus=1),
                                        g("gen", 1, "generator reward", gpus=1)))
BIG_WORKER = PlacementSpec("custom", (g("train", 1, "actor critic reference", cpus=3), g("gen", 1, "generator reward")))
CLUSTER = [
    (ONE_GPU_EACH, ClusterResources.one_node(2, gpus=3), ["needs 3 CPUs (3 workers: 2 x 1 + 1 x 1)", "cluster has 2",
                                                          "lower placement.workers"]),
    (ONE_GPU_EACH, ClusterResources.one_node(3, gpus=2), ["needs 3 GPUs", "cluster has 2", "gpus_per_worker=0"]),
    (BIG_WORKER, ClusterResources((NodeResources(2, 1), NodeResources(2, 1))),
     ["group 'train'", "one worker needs 3 CPU and 0 GPU", "more than any node has (2 CPU, 1 GPU)", "lower its"]),
]


@pytest.mark.parametrize("spec,cluster,expected", CLUSTER, ids=["cpus", "gpus", "node"])
def test_cluster_rules(spec, cluster, expected):
    (problem,) = check_placement(spec, roles_of(PPO), cluster)
    for part in expected:
        assert part in problem, (part, problem)


def test_cluster_totals_count_every_worker():
    spec = flattened(roles_of(PPO), 4, WorkerResources(cpus=1))
    assert check_placement(spec, roles_of(PPO), ClusterResources.one_node(4.0)) == []
    (problem,) = check_placement(spec, roles_of(PPO), ClusterResources.one_node(3.0))
    assert "needs 4 CPUs (4 workers: 4 x 1)" in problem


def test_memory_rule_uses_the_hook_and_skips_unknowns():
    roles = roles_of(PPO)
    per_group = {"train": 3 * 2**30, "gen": None}
    (problem,) = check_placement(GOOD, roles, None, lambda grp, spec: per_group[grp.name], 2 * 2**30)
    assert "group 'train': predicted 3.00 GiB per worker" in problem and "2.00 GiB budget" in problem
    assert "model.lora" in problem
    assert check_placement(GOOD, roles, None, lambda grp, spec: 2 * 2**30, 2 * 2**30) == []  # at the budget fits
    assert check_placement(GOOD, roles, None, None, 1) == []  # no memory model yet
    assert check_placement(GOOD, roles, None, lambda grp, spec: 2**40, None) == []  # no budget


def test_every_problem_is_collected_into_one_error():
    spec = PlacementSpec("custom", (g("train", 2, "actor generator"), g("score", 1, "reference critic")))
    with pytest.raises(PlacementError) as err:
        validate_placement(spec, roles_of(GRPO_LORA), ClusterResources.one_node(1))
    lines = str(err.value).splitlines()
    assert lines[0] == "placement: 4 problem(s):"
    assert [l[:4] for l in lines[1:]] == ["  - "] * 4
    assert len(err.value.problems) == 4
    text = str(err.value)
    for part in ("role 'reward' has no group", "role 'critic' is placed", "role 'reference' must share", "needs 3 CPUs"):
        assert part in text


# ----------------------------------------------------------------------------------------------- config

CUSTOM_YAML = """
rl:
  algo: grpo
  k: 4
model:
  lora: true
placement:
  strategy: custom
  cpus_per_worker: 2
  address: auto
  groups:
    - {name: train, workers: 2, roles: [actor, reference]}
    - {name: gen, workers: 1, roles: [generator, reward], gpus_per_worker: 0.5, cpus_per_worker: 1}
"""


def test_custom_groups_from_yaml_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CUSTOM_YAML)
    cfg = load_config(path)
    spec = spec_from_config(cfg)
    assert spec == PlacementSpec("custom", (WorkerGroup("train", 2, ("actor", "reference"), 2.0, 0.0),
                                            WorkerGroup("gen", 1, ("generator", "reward"), 1.0, 0.5)), "auto")
    assert spec_from_config(load_config(save_config(cfg, tmp_path / "run"))) == spec


@pytest.mark.parametrize("strategy", ["single", "flattened", "interleaved", "separated"])
def test_config_picks_the_strategy(strategy):
    cfg = load_config(None, [f"placement.strategy={strategy}", "placement.workers=4", "placement.gpus_per_worker=1"])
    spec = spec_from_config(cfg)
    assert spec.strategy == strategy and spec.uses_ray == (strategy != "single")
    if strategy != "single":
        assert spec.workers == 4 and spec.gpus == 4
    assert load_config(None).placement.strategy == "single"  # default: one process, as before


BAD_GROUPS = [
    ("- {name: train, workers: 2, roles: [actor, critic]}\n    - {name: gen, workers: 1, roles: [generator]}",
     "placement.groups", "role 'reference' has no group"),
    ("- {name: train, workers: 0, roles: [actor]}", "placement.groups[0].workers", "whole number >= 1"),
    ("- {name: train, wrokers: 1, roles: [actor]}", "placement.groups[0].wrokers", "did you mean workers?"),
    ("- {name: train, workers: 1}", "placement.groups[0].roles", "missing"),
    ("- {name: train, workers: 1, roles: 7}", "placement.groups[0].roles", "list of role names"),
    ("- {name: train, workers: 1, roles: [actor], cpus_per_worker: lots}", "placement.groups[0].cpus_per_worker",
     "number >= 0"),
    ("- actor", "placement.groups[0]", "expected a mapping"),
]


@pytest.mark.parametrize("groups,field,fix", BAD_GROUPS, ids=[b[1] + ":" + b[2] for b in BAD_GROUPS])
def test_bad_custom_groups_are_config_errors(tmp_path, groups, field, fix):
    path = tmp_path / "c.yaml"
    path.write_text(f"placement:\n  strategy: custom\n  groups:\n    {groups}\n")
    with pytest.raises(ConfigError) as err:
        resolve(load_config(path))  # the fields when the config loads; the layout (roles placed) in resolve
    assert err.value.field == field and fix in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------- pure

def test_placement_modules_import_neither_torch_nor_ray():
    code = ("import sys; import rlfuse.plan.spec, rlfuse.plan.strategies, rlfuse.plan.check, "
            "rlfuse.config; print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"

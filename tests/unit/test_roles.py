"""Roles from the config: which exist, which train, where they load from, which must share a process."""

import pytest

from rlfuse.config import load_config
from rlfuse.plan.roles import derive_roles

FN = "rlfuse.data.gold:gold_reward"

# algo, lora, critic_init, reward -> roles, sources, colocated groups of more than one role
CASES = [
    ("ppo", False, "rm", "rm", {"actor": "sft", "generator": "actor", "reference": "sft", "critic": "rm", "reward": "rm"},
     []),
    ("ppo", False, "sft", FN, {"actor": "sft", "generator": "actor", "reference": "sft", "critic": "sft",
                               "reward": f"function:{FN}"}, []),
    ("ppo", False, "actor", "rm", {"actor": "sft", "generator": "actor", "reference": "sft", "critic": "actor",
                                   "reward": "rm"}, [{"actor", "critic"}]),
    ("ppo", True, "rm", "rm", {"actor": "sft", "generator": "actor", "reference": "sft", "critic": "rm", "reward": "rm"},
     [{"actor", "reference"}]),
    ("ppo", True, "actor", FN, {"actor": "sft", "generator": "actor", "reference": "sft", "critic": "actor",
                                "reward": f"function:{FN}"}, [{"actor", "reference", "critic"}]),
    ("rloo", False, "actor", "rm", {"actor": "sft", "generator": "actor", "reference": "sft", "reward": "rm"}, []),
    ("grpo", True, "rm", FN, {"actor": "sft", "generator": "actor", "reference": "sft", "reward": f"function:{FN}"},
     [{"actor", "reference"}]),
]


@pytest.mark.parametrize("algo,lora,critic_init,reward,sources,shared", CASES)
def test_roles_table(algo, lora, critic_init, reward, sources, shared):
    k = 1 if algo == "ppo" else 2
    cfg = load_config(None, [f"rl.algo={algo}", f"rl.k={k}", f"model.lora={str(lora).lower()}",
                             f"rl.critic_init={critic_init}", f"rl.reward={reward}"])
    roles = derive_roles(cfg)
    assert {r.name: r.source for r in roles.roles} == sources
    assert set(roles.trainable()) == ({"actor", "critic"} if algo == "ppo" else {"actor"})
    groups = roles.colocated_groups()
    assert [set(g) for g in groups if len(g) > 1] == shared
    assert set().union(*groups) == set(sources)  # every role in exactly one group
    assert sum(map(len, groups)) == len(sources)
    assert roles["reward"].has_model == (reward == "rm")


def test_roles_module_imports_no_torch():
    import ast
    import inspect

    import rlfuse.plan.roles as mod

    imported = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(inspect.getsource(mod)))
                if isinstance(n, (ast.Import, ast.ImportFrom)) and n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(inspect.getsource(mod)))
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "transformers", "peft"}, imported


def test_sharing_is_transitive():
    from rlfuse.plan.roles import Role, Roles

    roles = Roles((Role("a", True, "sft"), Role("b", False, "sft", "a"), Role("c", False, "sft", "b"),
                   Role("d", False, "rm")))
    assert [set(g) for g in roles.colocated_groups()] == [{"a", "b", "c"}, {"d"}]


@pytest.mark.parametrize("extra,shared", [
    (["model.shared_base=true"], [{"actor", "generator", "reference", "critic", "reward"}]),
    (["model.quantization=4bit"], [{"actor", "generator", "reference", "critic", "reward"}]),  # the default, quantised
    (["model.shared_base=true", f"rl.reward={FN}", "rl.critic_init=sft"], [{"actor", "generator", "reference", "critic"}]),
    (["model.shared_base=false"], [{"actor", "reference"}]),
])
def test_a_shared_base_puts_every_model_role_with_the_actor(extra, shared):
    roles = derive_roles(load_config(None, ["model.lora=true", *extra]))
    assert [set(g) for g in roles.colocated_groups() if len(g) > 1] == shared
    # the engine decodes the shared base itself; otherwise its own copy, which can live anywhere
    assert roles["generator"].shares_with == ("actor" if "generator" in shared[0] else None)

"""`rlfuse plan --paper`: the at-scale cases from published GPU figures."""

import pytest

from rlfuse.plan.cost import GiB
from rlfuse.plan.paper import actor_critic, qlora_7b_one_gpu
from rlfuse.plan.planner import best_plan


def test_qlora_7b_fits_one_24gb_gpu_with_a_3_9gb_base():
    best = best_plan(qlora_7b_one_gpu().problem)
    assert best.strategy == "single"  # one GPU: one process, no Ray
    mem = best.memory["main"]
    assert mem["base"] == pytest.approx(3.87e9, rel=0.01)  # 4.127-bit blocks + 16-bit embeddings and head
    assert mem["optimizer"] < 1e9  # 8-bit moments of the adapters only
    assert mem["total"] < 24e9 and best.fits


def test_7b_actor_critic_on_8_gpus_needs_its_groups_split():
    case = actor_critic("llama-2-7b", 8)
    best = best_plan(case.problem)
    assert best.fits and best.peak_bytes <= case.problem.memory_budget
    assert best.strategy != "flattened"  # every role on every GPU is over 80 GB even sharded 8 ways
    assert case.problem.memory_budget == pytest.approx(80e9) and best.peak_bytes > 40 * GiB

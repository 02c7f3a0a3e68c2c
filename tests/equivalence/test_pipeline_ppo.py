"""The pipelined PPO update (rlfuse/runtime/pipeline.py) on P = 2 gloo processes, actor stage r and critic stage
1 - r on rank r, ends with the actor and critic weights of one process calling learn/update.py's update on the same experience:
AdamW, 2 epochs x 2 mini-batches of 3 micro-batches of unequal lengths, a max gradient norm small enough that
clipping binds (so the norm must be taken over both stages), for the serial and the fused schedule (GPT-2), and the
fused one on a Llama-style model."""

from pathlib import Path

import pytest
import torch

from helpers import hand_experience, make_tiny_llama
from rlfuse.config import load_config
from rlfuse.models.build import build_models
from rlfuse.runtime.pipeline import build_pipeline, spawn, stage_state
from rlfuse.learn.learners import build_learners
from rlfuse.learn.advantages import compute_advantages
from rlfuse.learn.batches import minibatches
from rlfuse.learn.update import BadSteps, update

KL = 0.05
CLIP = 0.05  # the gradient norms here are ~0.5-5: every step clips


def rl_config(model_dir, *extra):
    return load_config(None, [f"rl.sft_path={model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", "rl.algo=ppo",
                              "rl.k=2", "rl.critic_init=sft", "rl.lr=1e-3", "rl.critic_lr=2e-3", "rl.epochs=2",
                              "rl.prompts_per_iter=6", "rl.mini_batch_size=6", "rl.micro_batch_size=2",
                              f"rl.grad_clip={CLIP}", "run.threads=1", *extra])


def pipeline_rank(rank, cfg, modes, exp, adv, returns, batches, out_dir):
    """One rank: the models as train_rl builds them; per mode, from the same start, this rank's stages and one
    update; its weights, stats and spans (one process start for every mode: starting one costs seconds)."""
    models = build_models(cfg, Path(out_dir), torch.device("cpu"))
    start = {role: {k: v.clone() for k, v in getattr(models, role).state_dict().items()} for role in ("actor", "critic")}
    for mode in modes:
        for role, state in start.items():
            getattr(models, role).load_state_dict(state)
        pipe = build_pipeline(models.actor, models.critic, cfg.rl, mode, models.tokenizer.pad_token_id)
        bad = BadSteps()
        stats = pipe.update(exp, adv, returns, KL, batches, bad)
        torch.save({"state": stage_state(pipe, models.actor, models.critic), "stats": stats, "bad": bad,
                    "spans": pipe.last_spans, "plans": {n: p[1] for n, p in pipe.plans.items()}},
                   Path(out_dir) / f"{mode}_rank{rank}.pt")


def run_pipeline(cfg, modes, exp, adv, returns, batches, tmp_path) -> dict:
    """{mode: (whole trained weights by role, each rank's saved record)}."""
    spawn(2, pipeline_rank, cfg, modes, exp, adv, returns, batches, str(tmp_path))
    out = {}
    for mode in modes:
        parts = [torch.load(tmp_path / f"{mode}_rank{r}.pt", weights_only=False) for r in range(2)]
        state = {role: {} for role in ("actor", "critic")}
        for part in parts:
            for role, tensors in part["state"].items():
                for name, t in tensors.items():
                    if name in state[role]:  # the tied embedding, on both ends of the actor: the same after each step
                        torch.testing.assert_close(t, state[role][name], rtol=0, atol=0)
                    state[role][name] = t
        out[mode] = state, parts
    return out


def single_process(cfg, exp, adv, returns, batches, tmp_path):
    models = build_models(cfg, tmp_path, torch.device("cpu"))
    start = {"actor": {n: p.detach().clone() for n, p in models.actor.named_parameters()}}
    stats = update(models, build_learners(models, cfg.rl), exp, adv, returns, cfg.rl, KL, batches,
                   BadSteps())
    one = {role: {n: p.detach() for n, p in m.named_parameters()} for role, m in
           (("actor", models.actor), ("critic", models.critic))}
    return one, start, stats


SETTINGS: dict = {}  # kind -> setting: pytest would rebuild a parametrized module fixture when the order alternates


@pytest.fixture
def setting(request, tiny_task, tmp_path_factory):
    """(config, experience, advantages, returns, mini-batches, single-process weights, start, stats) on the tiny
    GPT-2 (tied embeddings) or a tiny Llama (rotary positions, untied head); built once per kind."""
    if request.param not in SETTINGS:
        SETTINGS[request.param] = build_setting(request.param, tiny_task, tmp_path_factory.mktemp("reference"))
    return SETTINGS[request.param]


def build_setting(kind, tiny_task, tmp):
    if kind == "gpt2":
        cfg = rl_config(tiny_task.model_dir)
    else:
        texts = ["a good film with a fine cast", "a dull plot and a bad ending", "not bad at all, rather good"] * 20
        cfg = rl_config(make_tiny_llama(tmp / "llama", texts))
    exp = hand_experience(build_models(cfg, tmp, torch.device("cpu")).actor, 12, cfg.rl.k, seed=3, longest=8)
    adv, returns, _ = compute_advantages(exp, cfg.rl, KL)
    batches = minibatches(len(exp), cfg.rl, cfg.run.seed, 0)
    assert len(batches) == 4  # 2 epochs x 2 mini-batches
    one, start, one_stats = single_process(cfg, exp, adv, returns, batches, tmp)
    return cfg, exp, adv, returns, batches, one, start, one_stats


@pytest.mark.parametrize("setting,modes", [("gpt2", ["pipeline_serial", "pipeline_fused"]),
                                           ("llama", ["pipeline_fused"])], indirect=["setting"], ids=["gpt2", "llama"])
def test_pipelined_update_equals_one_process(setting, tmp_path, modes):
    cfg, exp, adv, returns, batches, one, start, one_stats = setting
    for mode, (state, parts) in run_pipeline(cfg, modes, exp, adv, returns, batches, tmp_path).items():
        assert state.keys() == one.keys()
        for role in one:
            assert state[role].keys() == one[role].keys(), role  # every parameter is trained on some stage
            for n in one[role]:
                torch.testing.assert_close(state[role][n], one[role][n], msg=lambda m: f"{mode} {role}.{n}: {m}")
        assert all(not torch.equal(start["actor"][n], one["actor"][n]) for n in start["actor"])  # every one moved
        stats = parts[0]["stats"]
        untimed = lambda st: {k: v for k, v in st.items() if not k.startswith("time/")}
        assert untimed(stats) == untimed(parts[1]["stats"])  # gathered: every rank returns every model's stats
        for key in ("train/policy_loss", "train/value_loss", "train/grad_norm", "train/critic_grad_norm"):
            assert stats[key] == pytest.approx(one_stats[key], rel=1e-4), key
        assert min(stats["train/grad_norm"], stats["train/critic_grad_norm"]) > 2 * CLIP  # clipping binds
        assert 0 <= stats["train/pipeline_bubble_simulated"] < 1 and 0 < stats["train/pipeline_bubble"] < 1
        spans = parts[0]["spans"]
        assert len(spans) == 4 * 2 * 2 * 3 * 2  # mini-batches x models x stages x micro-batches x (F, B)
        assert all(e > s for *_, s, e in spans)
        assert set(parts[0]["plans"]) == {3}  # one cached schedule for every mini-batch of 3 micro-batches
        if mode == "pipeline_fused":  # a fused schedule interleaves the critic with the actor on some device
            orders = parts[0]["plans"][3].orders
            assert any(o.index(next(t for t in o if t.model == 1)) < max(i for i, t in enumerate(o) if t.model == 0)
                       for o in orders)


@pytest.mark.parametrize("setting", ["gpt2"], indirect=True)
def test_the_comparison_can_fail(setting, tmp_path):
    """The partner: an update whose clipping norm is off by 2x (as a norm of one stage instead of both would be)
    does not pass the same comparison."""
    cfg, exp, adv, returns, batches, one, _, _ = setting
    looser = rl_config(cfg.rl.sft_path, f"rl.grad_clip={2 * CLIP}")
    other, _, _ = single_process(looser, exp, adv, returns, batches, tmp_path)
    with pytest.raises(AssertionError):
        for role in one:
            for n in one[role]:
                torch.testing.assert_close(other[role][n], one[role][n])


def test_a_rejected_schedule_is_never_run(monkeypatch):
    """A schedule the checker rejects (a backward before its forward) stops the update before any rank runs it."""
    import rlfuse.runtime.pipeline as pipeline
    from rlfuse.config import RLConfig
    from rlfuse.schedule.model import ScheduleError, Task

    real = pipeline.serial

    def broken(prob):
        sched = real(prob)
        o = sched.orders[1]
        i, j = o.index(Task(0, 0, 1, "F", 0)), o.index(Task(0, 0, 1, "B", 0))
        o[i], o[j] = o[j], o[i]
        return sched

    monkeypatch.setattr(pipeline, "serial", broken)
    trainer = pipeline.PipelineTrainer("pipeline_serial", RLConfig(), 0, rank=0, world=2, parts={}, tied_group=None)
    with pytest.raises(ScheduleError):
        trainer.plan(2)
    assert trainer.plans == {}

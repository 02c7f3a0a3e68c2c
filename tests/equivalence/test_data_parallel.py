"""Data-parallel training on Ray (rlfuse/runtime/ray_train.py): 2 workers (gloo, 1 CPU each) updating on the same
experience end with the same actor and critic weights as one process calling learn/update.py's update, for PPO with a separate
critic (AdamW, 2 epochs x 2 mini-batches, 2 micro-batches per rank), GRPO (3 micro-batches per mini-batch: rank 0
runs 2, rank 1 runs 1 and a zero-weight padding one) and PPO with the value head on the actor's body (one
micro-batch of 6 per mini-batch, cut into one of 3 per rank). Summing gradients over ranks is what makes it equal:
averaging them, as DDP does without the loss scaled by the world size, moves the weights by half as much (test, with
SGD: Adam would hide a uniform scale)."""

import sys

import pytest
import torch

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' to run the Ray tests")

from helpers import hand_experience  # noqa: E402
from rlfuse.config import load_config  # noqa: E402
from rlfuse.models.build import build_models  # noqa: E402
from rlfuse.runtime.ray_train import start_train_workers  # noqa: E402
from rlfuse.learn.learners import build_learners  # noqa: E402
from rlfuse.learn.advantages import compute_advantages  # noqa: E402
from rlfuse.learn.batches import micro_batch_indices, minibatches, rank_slots  # noqa: E402
from rlfuse.models.forward import worth_sharing  # noqa: E402
from rlfuse.learn.update import BadSteps, update  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers below run inside the workers
KL = 0.05


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def rl_config(tiny_task, algo, *extra):
    k = 1 if algo == "ppo" else 2
    # fp32 whatever the CPU: the updates agree to fp32 rounding; under bf16 autocast the ranks' micro-batches (other
    # padding) round apart by more (the layouts under bf16: tests/integration/test_placement_precision.py)
    return load_config(None, [f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward",
                              f"rl.algo={algo}", f"rl.k={k}", "rl.critic_init=sft", "rl.lr=1e-3", "rl.critic_lr=1e-3",
                              "run.threads=1", "run.precision=fp32", *extra])


def single_process(cfg, tmp_path, start: dict, sgd_lr=None):
    """Models and learners as train_rl builds them, from the workers' starting weights."""
    models = build_models(cfg, tmp_path, torch.device("cpu"))
    for role, state in start.items():
        getattr(models, role).load_state_dict(state, strict=False)
    learners = build_learners(models, cfg.rl)
    if sgd_lr:
        use_sgd(learners, sgd_lr)
    return models, learners


def use_sgd(learners, lr):
    for learner in (learners.actor, learners.critic):
        if learner is not None:
            learner.opt = torch.optim.SGD([p for p in learner.module.parameters() if p.requires_grad], lr=lr)
            learner.sched = torch.optim.lr_scheduler.ConstantLR(learner.opt, 1.0, 0)


def reset_worker(worker, cfg, start, sgd_lr, mean_gradients):
    """Inside a worker: this test's config, the starting weights, fresh optimisers (SGD if sgd_lr) and, for the wrong
    weighting, gradients averaged over ranks (DDP's mean, the losses not scaled by the world size)."""
    from rlfuse.learn.learners import build_learners

    worker.cfg = cfg
    for role, state in start.items():
        getattr(worker.models, role).load_state_dict(state, strict=False)
    worker.learners = build_learners(worker.models, cfg.rl)
    if sgd_lr:
        use_sgd(worker.learners, sgd_lr)
    worker.group.loss_scale = 1.0 if mean_gradients else None


def run_both(cfg, tmp_path, exp, sgd_lr=None, mean_gradients=False, workers=None, start=None):
    """One update from `start` (default: the workers' current weights) in the workers and in one process ->
    (data-parallel trainable state, single-process trainable state, start, data-parallel stats, single stats)."""
    rl = cfg.rl
    adv, returns, _ = compute_advantages(exp, rl, KL)
    batches = minibatches(len(exp), rl, cfg.run.seed, 0)
    start = start or workers.trainable_states()[0]
    ray.get([w.__ray_call__.remote(reset_worker, cfg, start, sgd_lr, mean_gradients) for w in workers.workers])
    dp_stats, dp_bad, _ = workers.update(exp, adv, returns, KL, batches, BadSteps())
    states = workers.trainable_states()
    for role in states[0]:  # the ranks stay replicas
        for n, t in states[0][role].items():
            torch.testing.assert_close(states[1][role][n], t, rtol=0, atol=0)
    models, learners = single_process(cfg, tmp_path, start, sgd_lr)
    bad = BadSteps()
    one_stats = update(models, learners, exp, adv, returns, rl, KL, batches, bad)
    assert dp_bad == bad == BadSteps()
    one = {"actor": learners.actor.module, "critic": models.critic}
    one = {r: {n: p.detach() for n, p in m.named_parameters() if p.requires_grad} for r, m in one.items() if m is not None}
    return states[0], one, start, dp_stats, one_stats


def assert_same_update(dp, one, start, shared_body=False):
    assert dp.keys() == one.keys()
    moved = [n for n in start["actor"] if not torch.equal(start["actor"][n], one["actor"][n])]
    # a value head on the actor's body: the LM head (tied to the input embedding) ... every parameter still moves
    assert len(moved) == len(start["actor"]), "every actor parameter must change"
    if "critic" in one:  # a zero-initialised head: the critic's body moves only once the head has
        assert not torch.equal(start["critic"]["head.weight"], one["critic"]["head.weight"])
    if shared_body:  # the critic's body is the actor's: the same tensors
        body = [n for n in one["critic"] if n.startswith("backbone.")]
        assert body and all(any(torch.equal(one["critic"][n], t) for t in one["actor"].values()) for n in body[:3])
    for role in dp:
        for n in one[role]:
            torch.testing.assert_close(dp[role][n], one[role][n], msg=f"{role}.{n}")


def inference_forwards(worker, n: int) -> None:
    with torch.no_grad():
        for _ in range(n):
            worker.models.actor(input_ids=torch.tensor([[1, 2, 3, 4]]))


def test_fsdp_on_two_workers_equals_one_process(ray_cluster, tiny_task, tmp_path):
    """rl.train_parallel=fsdp (rlfuse/runtime/fsdp.py): each rank holds half of each tensor; one update on the same
    experience ends with the single-process weights (gathered), and each rank holds only its shard between updates.
    GRPO with LoRA (frozen base weights and trained adapters in each block) and 3 micro-batches per mini-batch: rank 1
    runs a zero-weight padding one, so that both ranks run the same forwards (FSDP's collectives). Every other prompt
    is long, so some micro-batches pay to share their prompt and others do not: a slot runs prefix-shared (the body
    twice) on both ranks or on neither (a rank sharing alone would wait for the other in a collective), and slots
    where both share are among them. PPO with a separate critic (two shard groups) runs end to end in
    tests/integration/test_placement_run.py. It comes before the tests below: its ranks must be gone before
    ppo_workers takes the cluster's 2 CPUs."""
    extra = ["rl.algo=grpo", "rl.k=2", "rl.prompts_per_iter=6", "rl.mini_batch_size=6", "rl.micro_batch_size=2",
             "rl.epochs=1", "model.lora=true", "model.lora_r=4"]
    cfg = rl_config(tiny_task, "grpo", *extra, "rl.train_parallel=fsdp", "placement.strategy=flattened",
                    "placement.workers=2")
    workers = start_train_workers(cfg, tmp_path, world=2)
    try:
        start = workers.trainable_states()[0]
        shard_sizes = ray.get(workers.workers[0].__ray_call__.remote(
            lambda w: {n: p.to_local().numel() for n, p in w.models.actor.named_parameters()}))
        # a rollout on the gathered weights first, each rank running its own number of forwards (as each scores what
        # it finished; here none on rank 0): FSDP records every forward's order to prefetch in the backward, and order
        # left over from the rollout made the ranks prefetch different blocks first: a deadlock (fails without
        # ShardedGroup.shard_again's reset_iter_state, found in the default task's first update)
        workers.begin_rollout()
        ray.get([w.__ray_call__.remote(inference_forwards, n) for w, n in zip(workers.workers, (0, 2))])
        exp = hand_experience(build_models(cfg, tmp_path, torch.device("cpu")).actor, len_of(cfg), cfg.rl.k,
                              longest=12, long_prompts=16)
        adv, returns, _ = compute_advantages(exp, cfg.rl, KL)
        batches = minibatches(len(exp), cfg.rl, cfg.run.seed, 0)
        slots = [[worth_sharing([exp.prompt_ids[i] for i in mb], [exp.response_ids[i] for i in mb]) for mb in slot]
                 for mini in batches for slot in all_slots(exp, mini, cfg.rl)]
        assert any(all(s) for s in slots) and any(any(s) and not all(s) for s in slots)
        dp_stats, dp_bad, _ = workers.update(exp, adv, returns, KL, batches, BadSteps())
        states = workers.trainable_states()
    finally:
        workers.shutdown()
    for role in states[0]:  # gathered: every rank returns the same whole tensors
        for n, t in states[0][role].items():
            torch.testing.assert_close(states[1][role][n], t, rtol=0, atol=0)
    models, learners = single_process(cfg, tmp_path, start)
    bad = BadSteps()
    one_stats = update(models, learners, exp, adv, returns, cfg.rl, KL, batches, bad)
    assert dp_bad == bad == BadSteps()
    one = {"actor": learners.actor.module, "critic": models.critic}
    one = {r: {n: p.detach() for n, p in m.named_parameters() if p.requires_grad} for r, m in one.items() if m is not None}
    assert_same_update(states[0], one, start)
    whole = {n: p.numel() for n, p in models.actor.named_parameters()}
    big = [n for n in whole if whole[n] >= 64]
    assert big and all(shard_sizes[n] <= -(-whole[n] // 2) for n in big)  # rank 0 holds about half of each
    assert dp_stats["train/grad_norm"] == pytest.approx(one_stats["train/grad_norm"], rel=1e-5, abs=1e-6)
    assert dp_stats["perf/prompt_tokens_shared_train"] > 0  # the sharded actor runs prefix-shared forwards


@pytest.fixture(scope="module")
def ppo_workers(ray_cluster, tiny_task, tmp_path_factory):
    """Two PPO ranks (separate critic) shared by the tests below: starting a worker costs seconds (imports, models);
    each test resets their config, weights and optimisers (reset_worker)."""
    workers = start_train_workers(rl_config(tiny_task, "ppo"), tmp_path_factory.mktemp("ppo"), world=2)
    yield workers
    workers.shutdown()


@pytest.mark.parametrize("algo,extra", [
    # grpo first: its ranks must be gone before ppo_workers takes the cluster's 2 CPUs
    ("grpo", ["rl.prompts_per_iter=6", "rl.mini_batch_size=6", "rl.micro_batch_size=2", "rl.epochs=1"]),
    # token-budget micro-batches (rl.micro_batch_tokens): the ranks split the same packed list one process walks
    ("grpo", ["rl.prompts_per_iter=6", "rl.mini_batch_size=12", "rl.micro_batch_size=2", "rl.epochs=1",
              "rl.micro_batch_tokens=24"]),
    # the value head on the actor's body: one DDP over the actor and the head, one backward of both losses
    ("ppo", ["rl.prompts_per_iter=6", "rl.mini_batch_size=6", "rl.micro_batch_size=6", "rl.epochs=1",
             "rl.critic_init=actor"]),
    ("ppo", ["rl.prompts_per_iter=8", "rl.mini_batch_size=4", "rl.micro_batch_size=1", "rl.epochs=2"]),
])
def test_two_workers_equal_one_process(ray_cluster, request, tiny_task, tmp_path, algo, extra):
    cfg = rl_config(tiny_task, algo, *extra)
    own = algo != "ppo" or "rl.critic_init=actor" in extra  # ranks of their own: other learners than ppo_workers'
    shared = "rl.critic_init=actor" in extra
    workers = start_train_workers(cfg, tmp_path, world=2) if own else request.getfixturevalue("ppo_workers")
    try:
        exp = hand_experience(build_models(cfg, tmp_path, torch.device("cpu")).actor, len_of(cfg), cfg.rl.k)
        dp, one, start, dp_stats, one_stats = run_both(cfg, tmp_path, exp, workers=workers)
    finally:
        if own:
            workers.shutdown()
    assert_same_update(dp, one, start, shared)
    assert ("critic" in dp) == (algo == "ppo")
    if algo == "grpo":  # k = 2 samples per prompt: some micro-batches ran prefix-shared (rl.share_prompt, the default)
        assert one_stats["perf/prompt_tokens_shared_train"] > 0
    assert one_stats["train/clip_frac"] > 0  # the clipped branch is exercised
    cut = "rl.micro_batch_size=6" in extra  # other micro-batches than one process: only the grad norm agrees
    for key in ("train/grad_norm",) if cut else ("train/policy_loss", "train/clip_frac", "train/grad_norm"):
        assert dp_stats[key] == pytest.approx(one_stats[key], rel=1e-5, abs=1e-6), key


def all_slots(exp, mini, rl):
    """Each slot's micro-batches, one per rank (the second rank's last a padding one where it has none)."""
    return rank_slots(micro_batch_indices(exp, mini, rl.micro_batch_size, 2), 2)


def len_of(cfg):
    return cfg.rl.prompts_per_iter * cfg.rl.k


def test_averaged_gradients_are_the_wrong_weighting(ppo_workers, tiny_task, tmp_path):
    """With SGD (linear in the gradient) summed gradients still match one process and averaged ones do not."""
    cfg = rl_config(tiny_task, "ppo", "rl.prompts_per_iter=8", "rl.mini_batch_size=8", "rl.micro_batch_size=2",
                    "rl.epochs=1", "rl.grad_clip=0")
    exp = hand_experience(build_models(cfg, tmp_path, torch.device("cpu")).actor, 8, 1)
    start = ppo_workers.trainable_states()[0]
    dp, one, *_ = run_both(cfg, tmp_path, exp, sgd_lr=0.1, workers=ppo_workers, start=start)
    assert_same_update(dp, one, start)
    wrong, *_ = run_both(cfg, tmp_path, exp, sgd_lr=0.1, mean_gradients=True, workers=ppo_workers, start=start)
    for role in one:
        for n in one[role]:  # the averaged step is half the single-process step
            torch.testing.assert_close(wrong[role][n] - start[role][n], (one[role][n] - start[role][n]) / 2,
                                       msg=f"{role}.{n}")
    assert any(not torch.allclose(wrong["actor"][n], one["actor"][n]) for n in one["actor"])

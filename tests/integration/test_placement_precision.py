"""run.precision and rollout.generator_dtype are resolved once, before a run (rlfuse/plan/resolve.py), and every
process of the run computes as the resolved config says: on a CPU that multiplies bf16 natively the single process and
the flattened, interleaved and separated layouts on 2 Ray workers all decode a bf16 copy of the policy and score and
train under bf16 autocast, so their first iteration has the same samples and the same rewards (the Ray workers used
to stay in fp32 whatever auto said). The runs' config.yaml records bf16; the fp32 run of the same seed gives other
rewards, so the comparison can fail. The resolution itself is checked without Ray, on any CPU."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from conftest import TINY
from helpers import seeded_rm_folders
from rlfuse.config import load_config
from rlfuse.plan.resolve import NATIVE_BF16_ENV, resolve, resolve_precision

FLATTENED = ["placement.strategy=flattened", "placement.workers=2"]


@pytest.mark.parametrize("native", ["1", "0"])
def test_auto_resolves_once_for_the_cpus_of_this_machine(monkeypatch, native):
    monkeypatch.setenv(NATIVE_BF16_ENV, native)
    want = "bf16" if native == "1" else "fp32"
    for placement in ([], FLATTENED, ["placement.strategy=separated", "placement.workers=2"]):
        cfg = resolve(load_config(None, ["run.device=cpu", *placement]), log=lambda *_: None)
        assert (cfg.run.precision, cfg.rollout.generator_dtype) == (want, want), placement
    # explicit values stay; full fine-tuning decodes a bf16 copy only where the update computes in bf16 too (LoRA's
    # merged copy does either way); sharded training runs fp32 throughout, whatever the precision of SFT and RM
    cfg = resolve(load_config(None, ["run.device=cpu", "run.precision=fp32"]), log=lambda *_: None)
    assert (cfg.run.precision, cfg.rollout.generator_dtype) == ("fp32", "fp32")
    cfg = resolve(load_config(None, ["run.device=cpu", "run.precision=fp32", "model.lora=true"]), log=lambda *_: None)
    assert (cfg.run.precision, cfg.rollout.generator_dtype) == ("fp32", want)
    cfg = resolve(load_config(None, ["run.device=cpu", *FLATTENED, "rl.train_parallel=fsdp"]), log=lambda *_: None)
    assert (cfg.run.precision, cfg.rollout.generator_dtype) == (want, "fp32")
    # where this machine is not where the roles compute, auto stays for each process to resolve on its own device
    for elsewhere in (["placement.gpus_per_worker=1"], ["placement.address=10.0.0.5:6379"]):
        cfg = resolve_precision(load_config(None, [*FLATTENED, *elsewhere]))
        assert (cfg.run.precision, cfg.rollout.generator_dtype) == ("auto", "auto"), elsewhere


# ------------------------------------------------------------------------------------------- the runs, in bf16

NATIVE = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
needs_native_bf16 = pytest.mark.skipif(
    not NATIVE, reason="this CPU has neither AVX512-BF16 nor AMX: bf16 is emulated here, so run.precision=auto is "
    "fp32 and tests/integration/test_placement_run.py already compares the layouts in fp32")

RL = ["rl.algo=ppo", "rl.critic_init=rm", "rl.iterations=1", "rl.prompts_per_iter=4", "rl.k=2", "rl.mini_batch_size=4",
      "rl.micro_batch_size=2", "rl.max_new_tokens=12", "rl.epochs=1", "rl.eval_prompts=0", "rl.lr=1e-3",
      "rollout.score_every=2", "run.threads=1", "rl.log_samples_every=1"]
REWARD_TOL = {"rtol": 2 ** -8, "atol": 1e-3}
"""Rewards of the same samples in two layouts: the reward model's passes under bf16 autocast round apart on other
micro-batches (the layouts score samples as they finish, the single process all at once: other padding), by up to
1.1e-3 a sample on the default task (rewards of -2 to 5, mean 1.58602 in one process, 1.58598 to 1.58605 on Ray)."""
LAYOUTS = {"flattened": FLATTENED, "interleaved": ["placement.strategy=interleaved", "placement.workers=2"],
           "separated": ["placement.strategy=separated", "placement.workers=2"]}


@pytest.fixture(scope="module")
def runs(tiny_task, tmp_path_factory):
    """One iteration from the same SFT and RM, with RLFUSE_NATIVE_BF16=1 (set before Ray starts here, so its workers
    inherit it): in one process under auto and in fp32, and in each Ray layout under auto (separated also
    asynchronous, rl.max_staleness=1). -> {name: (first metrics
    row, each sample's reward, trained actor, config.yaml, each sample's completion)}."""
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' for the placement tests")
    from rlfuse.cli import main

    root = tmp_path_factory.mktemp("precision")
    folders = seeded_rm_folders(str(tiny_task.model_dir), root)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(NATIVE_BF16_ENV, "1")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for name, extra in {"single": [], "fp32": ["run.precision=fp32", "rollout.generator_dtype=fp32"],
                                **LAYOUTS, "async": [*LAYOUTS["separated"], "rl.max_staleness=1"]}.items():
                run_dir = root / name
                assert main(["rl", f"run.dir={run_dir}", *TINY, *folders, *RL, *extra]) == 0
                rl = run_dir / "rl"
                out[name] = (json.loads((rl / "metrics.jsonl").read_text().splitlines()[0]),
                             torch.tensor(json.loads((rl / "last_rewards.json").read_text())),
                             load_file(str(rl / "model" / "model.safetensors")),
                             load_config(str(run_dir / "config.yaml")),
                             [json.loads(row)["completion"] for row in (rl / "samples.jsonl").read_text().splitlines()])
        finally:
            ray.shutdown()
    return out


def update_distance(got: dict, want: dict, start: dict) -> float:
    """How far one run's update of the actor is from another's: |got - want| / |want - start| over all weights."""
    names = [n for n in want if n in start]
    diff = torch.cat([(got[n] - want[n]).flatten() for n in names])
    return float(diff.norm() / torch.cat([(want[n] - start[n]).flatten() for n in names]).norm())


@needs_native_bf16
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_samples_scores_and_trains_in_the_single_process_bf16(runs, tiny_task, layout):
    want_row, want_rewards, want_actor, want_cfg, want_samples = runs["single"]
    row, rewards, actor, cfg, samples = runs[layout]
    # the config resolved once, recorded in the run folder, read by the driver and every worker
    assert (want_cfg.run.precision, want_cfg.rollout.generator_dtype) == ("bf16", "bf16")
    assert (cfg.run.precision, cfg.rollout.generator_dtype) == ("bf16", "bf16")
    # the same samples (all 8 of the iteration), scored alike (REWARD_TOL)
    assert len(samples) == len(rewards) == 8 and samples == want_samples
    assert row["rollout/length_mean"] == want_row["rollout/length_mean"]
    assert_close(rewards, want_rewards, **REWARD_TOL)
    assert_close(row["reward/mean"], want_row["reward/mean"], **REWARD_TOL)
    # the update saw a bf16 sampler (the decoupled objective's behaviour weights, near 1), and its policy's and the
    # reference's log-probs in one arithmetic: before any update they are the same policy, so the KL is 0
    assert 0.99 < row["train/behaviour_weight_mean"] < 1.01 and want_row["train/behaviour_weight_mean"] is not None
    assert row["reward/kl"] == want_row["reward/kl"] == 0.0
    # the same update, to bf16 rounding: Adam's first step moves every weight by about lr whatever its gradient's
    # size, so a weight whose gradient rounds to the other sign moves the other way; 2-3% of the update's norm here,
    # against 58% between the bf16 and the fp32 single process
    start = load_file(str(tiny_task.model_dir / "model.safetensors"))
    assert update_distance(actor, want_actor, start) < 0.1
    assert update_distance(runs["fp32"][2], want_actor, start) > 0.3


@needs_native_bf16
@pytest.mark.slow
def test_the_comparison_tells_bf16_from_fp32(runs):
    # the fp32 run of the same seed (what the Ray layouts computed before they honoured auto) samples or scores
    # otherwise: the layouts' agreement above is not one every precision would pass
    (_, bf16, _, _, _), (_, fp32, _, cfg, _) = runs["single"], runs["fp32"]
    assert (cfg.run.precision, cfg.rollout.generator_dtype) == ("fp32", "fp32")
    with pytest.raises(AssertionError):
        assert_close(fp32, bf16, **REWARD_TOL)


@needs_native_bf16
@pytest.mark.slow
def test_the_asynchronous_loop_corrects_its_fresh_bf16_batches_too(runs):
    # separated with rl.max_staleness=1: a batch the current weights sampled is off-policy too where the sampler is a
    # bf16 copy, so it is scored with the trained policy's own log-probs for the decoupled objective, as in one process
    # (in fp32 a fresh batch is on-policy and gets no such pass: tests/integration/test_async_rl.py)
    want_row, want_rewards, _, _, want_samples = runs["single"]
    row, rewards, _, cfg, samples = runs["async"]
    assert (cfg.run.precision, cfg.rollout.generator_dtype) == ("bf16", "bf16")
    assert samples == want_samples
    assert_close(rewards, want_rewards, **REWARD_TOL)
    assert row["async/staleness_max"] == 0 and row["time/proximal_logprobs"] > 0
    assert 0.99 < row["train/behaviour_weight_mean"] < 1.01

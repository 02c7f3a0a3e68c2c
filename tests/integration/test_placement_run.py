"""`rlfuse rl` with placement.strategy=flattened | interleaved | separated on 2 Ray workers (Ray started here): each
run finishes, logs weight sync, migration and per-worker time and memory, trains on the actor's group (2 ranks
data-parallel under flattened, 1 otherwise), and after 3 iterations its actor equals
the single-process run's from the same SFT and RM folders (per-sample streams: the same samples wherever they are
decoded), and a second flattened run ends with the same bits. The single-process reference runs once; the strategies
share one Ray session."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from conftest import ROOT, TINY
from helpers import seeded_rm_folders
from rlfuse.cli import main

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' for the placement tests")

# fp32 whatever the CPU: the comparisons below are fp32's (bit for bit, or to fp32 rounding); the same layouts under
# bf16 (run.precision=auto on a CPU with native bf16) are tests/integration/test_placement_precision.py's
RL = ["rl.algo=ppo", "rl.critic_init=rm", "rl.iterations=3", "rl.prompts_per_iter=4", "rl.k=2", "rl.mini_batch_size=4",
      "rl.micro_batch_size=2", "rl.max_new_tokens=12", "rl.epochs=1", "rl.eval_prompts=4", "rl.lr=1e-3",
      "rollout.score_every=2", "run.threads=1", "run.precision=fp32", "rollout.generator_dtype=fp32"]


@pytest.fixture(scope="module")
def folders(tiny_task, tmp_path_factory):
    """SFT = the tiny base model; RM = the base with a seeded scalar head (reward and the critic's start)."""
    return seeded_rm_folders(str(tiny_task.model_dir), tmp_path_factory.mktemp("placement_models"))


def run_rl(run_dir, folders, *extra):
    assert main(["rl", f"run.dir={run_dir}", *TINY, *folders, *RL, *extra]) == 0
    rows = [json.loads(l) for l in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    last_rewards = torch.tensor(json.loads((run_dir / "rl" / "last_rewards.json").read_text()))
    return rows, load_file(str(run_dir / "rl" / "model" / "model.safetensors")), last_rewards


@pytest.fixture(scope="module")
def single(folders, tmp_path_factory):
    return run_rl(tmp_path_factory.mktemp("single"), folders)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# the tiny model's samples all run to the length limit, so only a forced migration (at the first pause point) moves
# rows under flattened
FLATTENED = ["placement.strategy=flattened", "placement.workers=2", "rollout.migrate_below=1.0"]
flattened_runs = []


# two halves on two test workers (tests/conftest.py): the flattened runs and the FSDP runs, whose later tests
# compare bits with the earlier ones' runs, and the runs with a role of their own on each worker
FLAT, ROLES = pytest.mark.split_group("flattened"), pytest.mark.split_group("roles")


@pytest.mark.parametrize("strategy", [pytest.param("flattened", marks=FLAT), pytest.param("interleaved", marks=ROLES),
                                      pytest.param("separated", marks=ROLES)])
def test_strategy_runs_on_two_workers_and_trains_as_one_process(strategy, tiny_task, folders, single, ray_session,
                                                                 tmp_path):
    start = load_file(str(tiny_task.model_dir / "model.safetensors"))
    placement = FLATTENED if strategy == "flattened" else [f"placement.strategy={strategy}", "placement.workers=2"]
    rows, actor, rewards = run_rl(tmp_path, folders, *placement)
    if strategy == "flattened":
        flattened_runs.append((rows, actor))
    want_rows, want_actor, want_rewards = single
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # the critic goes to the scoring workers where they do not train it (interleaved's "score" group); the
        # actor's weights go through the object store only to generators without a replica (separated); a worker
        # with a replica decodes it in place (full fine-tuning), as the single process does: nothing loaded
        assert want_rows[0]["sync/bytes"] == 0
        assert (r["sync/bytes"] > 0) == (strategy != "flattened")
        assert (r["sync/sent_bytes"] > 0) == (strategy != "flattened")
        assert r["time/weight_sync"] > 0
        assert r["train/data_parallel_ranks"] == (2 if strategy == "flattened" else 1)
        assert {"migration/rows_moved", "migration/migrated", "time/rollout", "time/scoring"} <= set(r)
        assert not any(k.startswith("time/migration") or k.startswith("time/busy") for k in r)
        for w in (0, 1):
            assert r[f"worker/{w}/busy_s"] > 0 and r[f"worker/{w}/rss_mb"] > 50
        trained = [w for w in (0, 1) if f"worker/{w}/train_s" in r]  # the actor's group: rank 0 (and 1 if flattened)
        assert trained == [0, 1][: r["train/data_parallel_ranks"]] and all(r[f"worker/{w}/train_s"] > 0 for w in trained)
    # the report shows per-worker time and memory
    assert "Workers (placement on Ray)" in (tmp_path / "report.html").read_text()
    assert (tmp_path / "figures" / "worker_usage.png").stat().st_size > 1000
    # separated and interleaved have one decoding worker, so nothing to migrate to (that a migrated tail leaves samples
    # and scores unchanged is tests/integration/test_ray_rollout.py's job)
    if strategy != "flattened":
        assert all(r["migration/rows_moved"] == 0 and r["migration/migrated"] == 0 for r in rows)
    else:
        assert all(r["migration/migrated"] == 1 and r["migration/rows_moved"] > 0 for r in rows)
    # the same samples in the same order: the last iteration's reward of every sample, and each iteration's means
    assert_close(rewards, want_rewards)
    for got, want in zip(rows, want_rows):
        assert got["rollout/length_mean"] == want["rollout/length_mean"]
        assert_close(got["reward/mean"], want["reward/mean"])
    assert_actor_as_single(actor, want_actor, start)


@FLAT
def test_two_flattened_runs_end_with_the_same_bits(folders, ray_session, tmp_path):
    # the migration from pause points, scoring batches by chunk, DDP's fixed reduction: nothing depends on which
    # worker replies first, so the same seed and placement give bit-identical weights and metrics
    if not flattened_runs:
        flattened_runs.append(run_rl(tmp_path / "first", folders, *FLATTENED)[:2])
    want_rows, want_actor = flattened_runs[0]
    rows, actor, _ = run_rl(tmp_path / "second", folders, *FLATTENED)
    assert actor.keys() == want_actor.keys()
    assert all(torch.equal(actor[name], want_actor[name]) for name in actor)
    for got, want in zip(rows, want_rows):
        for key in ("reward/mean", "reward/kl", "train/policy_loss", "train/grad_norm", "train/value_loss",
                    "migration/rows_moved", "rollout/length_mean"):
            assert got[key] == want[key], key


@ROLES
def test_lora_weight_sync_of_the_adapters_alone_gives_the_merged_syncs_bits(folders, ray_session, tmp_path):
    # separated with LoRA: the generation worker merges the adapters it is sent on its own copy of the SFT model, the
    # same base and adapter tensors as the trainer's merge, so its generator gets the same bits as a merged sync:
    # the same samples, the same trained weights, bit for bit; a small fraction of the bytes sent
    runs = {}
    for sync in ("merged", "adapters"):
        rows, actor, rewards = run_rl(tmp_path / sync, folders, "placement.strategy=separated", "placement.workers=2",
                                      "model.lora=true", f"rollout.weight_sync={sync}", "rl.iterations=2")
        runs[sync] = rows, actor, rewards
    (merged_rows, merged, merged_rewards), (rows, actor, rewards) = runs["merged"], runs["adapters"]
    assert torch.equal(rewards, merged_rewards)
    assert actor.keys() == merged.keys() and all(torch.equal(actor[n], merged[n]) for n in actor)
    for got, want in zip(rows, merged_rows):
        assert got["reward/mean"] == want["reward/mean"] and got["rollout/length_mean"] == want["rollout/length_mean"]
        assert 0 < got["sync/sent_bytes"] < want["sync/sent_bytes"] / 10


@FLAT
def test_a_recipe_with_token_mean_over_the_batch_trains_on_two_ranks_as_one_process(tiny_task, folders, ray_session,
                                                                                      tmp_path):
    """rl.recipe=dapo: the loss is the mean over every token of the batch (token-mean), which two data-parallel ranks
    must share by the batch's token count, not each average its own half; and the clip-higher range."""
    dapo = ["rl.algo=grpo", "rl.recipe=dapo", "rl.critic_init=sft"]
    _, want_actor, want_rewards = run_rl(tmp_path / "single", folders, *dapo)
    rows, actor, rewards = run_rl(tmp_path / "flat", folders, *FLATTENED, *dapo)
    assert all(r["train/data_parallel_ranks"] == 2 for r in rows)
    assert_close(rewards, want_rewards)
    assert_actor_as_single(actor, want_actor, load_file(str(tiny_task.model_dir / "model.safetensors")))


def assert_actor_as_single(actor, want_actor, start):
    # Samples are identical; what differs is rounding: the workers score other micro-batches than the single
    # process, and a migrated row's re-prefilled log-probs round differently (< 1e-5). Adam divides each gradient by
    # its own running scale, so in a coordinate whose gradient is near zero a rounding-level change moves the weight
    # by a visible fraction of one step (lr): seen up to 1.6e-5 after 6 steps (flattened, from the scoring
    # micro-batches alone). atol = lr / 10 is 60x below what the 6 steps can move a weight, and the run moved the
    # weights far more than that (checked below).
    atol = 1e-4
    assert actor.keys() == want_actor.keys()
    for name in actor:
        assert_close(actor[name], want_actor[name], atol=atol, rtol=1.3e-6, msg=lambda m: f"{name}: {m}")
    moved = max(float((actor[n] - start[n]).abs().max()) for n in actor if n in start)
    assert moved > 10 * atol


@ROLES
def test_pipeline_stages_on_two_workers_train_as_one_process(tiny_task, folders, single, ray_session, tmp_path):
    """rl.train_parallel=pipeline_fused: each worker trains actor stage r and critic stage 1 - r on one fused schedule
    (rlfuse/runtime/pipeline.py); the run's actor equals the single process's, and each rank checkpoints its
    stages' optimiser states beside the checkpoint."""
    start = load_file(str(tiny_task.model_dir / "model.safetensors"))
    rows, actor, rewards = run_rl(tmp_path, folders, "placement.strategy=flattened", "placement.workers=2",
                                  "rl.train_parallel=pipeline_fused")
    want_rows, want_actor, want_rewards = single
    assert [r["train/pipeline_stages"] for r in rows] == [2, 2, 2]
    assert all("train/data_parallel_ranks" not in r and r["time/train_pipeline"] > 0 for r in rows)
    assert_close(rewards, want_rewards)  # the critic scored with (synced from both stages) is the single process's
    assert all((tmp_path / "rl" / f"checkpoint.pt.stage{r}").stat().st_size > 0 for r in (0, 1))
    assert_actor_as_single(actor, want_actor, start)
    # the last update's schedule, executed and simulated, and the report's chart of both
    import json

    from rlfuse.metrics.report import draw_figures
    record = json.loads((tmp_path / "rl" / "pipeline_schedule.json").read_text())
    tasks = 2 * 2 * 2 * record["micro_batches"]  # 2 models x 2 stages x (F, B) per micro-batch
    assert record["devices"] == 2 and len(record["executed"]) == len(record["simulated"]) == tasks
    assert 0 <= record["bubble_simulated"] < 1 and 0 <= record["bubble_executed"] < 1
    assert draw_figures(tmp_path)["pipeline_schedule"].stat().st_size > 0


FSDP = [*FLATTENED, "rl.train_parallel=fsdp", "rl.ckpt_every=1"]
fsdp_runs = []


@FLAT
def test_fsdp_shards_train_as_one_process_and_checkpoint_with_dcp(tiny_task, folders, single, ray_session, tmp_path):
    """rl.train_parallel=fsdp (rlfuse/runtime/fsdp.py) flattened on 2 workers: the shards are gathered for each
    rollout (both workers decode and score on whole weights), trained as shards, and the run's actor equals the single
    process's; every checkpoint is a DCP folder of both ranks' shards beside a checkpoint.pt without weights, and only
    the kept checkpoints' folders stay."""
    start = load_file(str(tiny_task.model_dir / "model.safetensors"))
    rows, actor, rewards = run_rl(tmp_path, folders, *FSDP)
    fsdp_runs.append(actor)
    want_rows, want_actor, want_rewards = single
    assert [r["train/data_parallel_ranks"] for r in rows] == [2, 2, 2]
    assert all(r["sync/bytes"] == 0 and r["migration/rows_moved"] > 0 for r in rows)  # decoded in place, migrated
    # the reference's log-probs and the critic's values in their own passes after decoding (neither whole beside
    # the whole actor), equal to the single process's fused ones: the same updates follow
    assert all(r["time/deferred_scoring"] > 0 for r in rows)
    assert_close(rewards, want_rewards)
    assert_actor_as_single(actor, want_actor, start)
    ckpt = torch.load(tmp_path / "rl" / "checkpoint.pt", weights_only=False)
    assert ckpt["iteration"] == 3 and ckpt["actor"] is None and ckpt["opt_actor"] is None
    folders_left = sorted(p.name for p in (tmp_path / "rl").glob("checkpoint.pt.shards-*"))
    assert folders_left == ["checkpoint.pt.shards-000002", "checkpoint.pt.shards-000003"]  # checkpoint.pt and .prev
    assert ckpt["shards"] == folders_left[-1]
    shards = sorted(p.name for p in (tmp_path / "rl" / ckpt["shards"]).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own


@ROLES
def test_fsdp_training_ranks_that_do_not_decode_send_the_weights_a_tensor_at_a_time(folders, ray_session, tmp_path):
    """separated on 3 workers: 2 FSDP ranks train and score, 1 decodes. No rank gathers the whole actor: the generator's
    weights leave the shards a tensor at a time (ray_train.TrainWorker.streamed_weights), the reference's pass runs
    after the decoding, and the run trains as the single process does. GRPO: no critic, the reference's pass alone
    deferred (the flattened PPO runs above defer the critic's too)."""
    start = load_file(str(folders[0].split("=", 1)[1] + "/model.safetensors"))
    grpo = ["rl.algo=grpo", "rl.reward=rlfuse.data.gold:gold_reward", "rl.iterations=2"]
    want_rows, want_actor, want_rewards = run_rl(tmp_path / "single", folders, *grpo)
    rows, actor, rewards = run_rl(tmp_path / "fsdp", folders, *grpo, "placement.strategy=separated",
                                  "placement.workers=3", "placement.cpus_per_worker=0.6", "rl.train_parallel=fsdp")
    assert all(r["sync/streamed"] == 1 and r["sync/sent_bytes"] > 0 and r["train/data_parallel_ranks"] == 2
               and r["time/deferred_scoring"] > 0 for r in rows)
    assert_close(rewards, want_rewards)
    assert_actor_as_single(actor, want_actor, start)


@FLAT
def test_an_fsdp_run_killed_and_resumed_ends_with_the_uninterrupted_runs_bits(tiny_task, folders, ray_session,
                                                                             tmp_path):
    """SIGKILL of the driver and its Ray after the first sharded checkpoint, then --resume: each rank reads its
    shards (weights and AdamW states) back, and the run ends with the uninterrupted fsdp run's weights, bit for bit."""
    if not fsdp_runs:
        fsdp_runs.append(run_rl(tmp_path / "full", folders, *FSDP)[1])
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "rlfuse", "rl", f"run.dir={killed}", *TINY, *folders, *RL, *FSDP]
    proc = subprocess.Popen(cmd, env=os.environ | {"CI": "true"}, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = killed / "rl" / "checkpoint.pt"
    deadline = time.time() + 180
    while time.time() < deadline and not ckpt.exists():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray workers, as a lost machine would
    proc.wait(timeout=60)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["iteration"] in (1, 2) and not (killed / "rl" / "model").exists()
    assert main(["rl", "--resume", str(killed)]) == 0  # in this process, on the module's Ray
    actor = load_file(str(killed / "rl" / "model" / "model.safetensors"))
    want = fsdp_runs[0]
    assert actor.keys() == want.keys() and all(torch.equal(actor[n], want[n]) for n in actor)

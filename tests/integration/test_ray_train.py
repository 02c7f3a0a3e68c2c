"""Training workers on Ray (rlfuse/runtime/ray_train.py), the trainer side of weight sync and checkpoints: rank 0's
actor weights, sent in object-store buckets, load into a DecodeEngine and reproduce the actor's logits (LoRA merged
in), read in place from the store's pages; the driver's pull of the trained weights reproduces them too; rank 0's
checkpoint is learn/checkpoint.py's file and restores the same actor in one process."""

import sys

import pytest
import torch

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' to run the Ray tests")

from rlfuse.config import load_config  # noqa: E402
from rlfuse.models.build import build_models, load_policy  # noqa: E402
from rlfuse.runtime.ray_common import StoredTensor, put_tensors, tensors_of  # noqa: E402
from rlfuse.runtime.ray_train import start_train_workers  # noqa: E402
from rlfuse.rollout.engine import DecodeEngine  # noqa: E402
from rlfuse.learn.checkpoint import load_checkpoint  # noqa: E402
from rlfuse.learn.learners import build_learners  # noqa: E402
from rlfuse.learn.checkpoint import checkpoint_parts  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers below run inside the workers
IDS = torch.tensor([[5, 9, 13, 2, 7, 30, 11], [3, 4, 8, 1, 22, 17, 6]])


def move_adapters(worker):
    """Inside a worker: LoRA B away from zero, so the merged actor differs from the SFT base."""
    g = torch.Generator().manual_seed(worker.rank)  # different per rank, as a trained replica never is: rank 0 counts
    with torch.no_grad():
        for n, p in worker.models.actor.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def actor_logits(worker, ids):
    worker.models.actor.eval()
    with torch.no_grad():
        return worker.models.actor(input_ids=ids).logits


@pytest.fixture(scope="module")
def lora_workers(tiny_task, tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = load_config(None, [f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward",
                             "rl.algo=grpo", "rl.k=2", "model.lora=true", "run.threads=1"])
    workers = start_train_workers(cfg, tmp_path_factory.mktemp("lora"), world=2)
    ray.get([w.__ray_call__.remote(move_adapters) for w in workers.workers])
    yield cfg, workers
    workers.shutdown()
    ray.shutdown()


def test_weight_buckets_load_into_an_engine(lora_workers, tiny_task):
    cfg, workers = lora_workers
    want = ray.get(workers.workers[0].__ray_call__.remote(actor_logits, IDS))
    engine = DecodeEngine(load_policy(str(tiny_task.model_dir)).eval(), 0)
    with torch.no_grad():
        before = engine.model(input_ids=IDS).logits
    assert not torch.allclose(before, want, atol=1e-3)  # the adapters moved the actor away from the base
    sent = workers.actor_weights(bucket_bytes=64 << 10)
    assert len(sent.refs) > 1  # really bucketed
    written = sum(engine.load_weights(tensors_of(ray.get(ref))) for ref in sent.refs)  # as a worker loads them
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=IDS).logits, want)
    params = list(engine.model.parameters())  # a tied weight (GPT-2's lm_head is wte) moves once
    assert written == sent.bytes == sum(p.numel() * p.element_size() for p in params)
    assert sent.seconds > 0


def test_stored_tensors_come_back_as_views_of_the_store(lora_workers):
    """Every dtype and shape round-trips bit for bit, bf16 and 0-d included, and a reader gets read-only views on the
    object's pages: no second copy of the weights in the reading process (a pickled torch tensor is unpickled into
    one)."""
    sent = {"w": torch.randn(3, 5), "bf": torch.randn(4, 2).to(torch.bfloat16), "ids": torch.arange(6).view(2, 3),
            "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "strided": torch.randn(4, 6)[:, ::2]}
    stored = ray.get(put_tensors(sent))
    assert all(isinstance(s, StoredTensor) and not s.data.flags.writeable for s in stored.values())
    back = tensors_of(stored)
    for name, t in sent.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t), name
    plain = {"x": torch.ones(2)}
    assert tensors_of(plain)["x"] is plain["x"]  # tensors handed over in-process pass through


def test_pull_into_gives_the_driver_the_trained_actor(lora_workers, tiny_task, tmp_path):
    cfg, workers = lora_workers
    want = ray.get(workers.workers[0].__ray_call__.remote(actor_logits, IDS))
    models = build_models(cfg, tmp_path, torch.device("cpu"))
    models.actor.eval()
    with torch.no_grad():
        assert not torch.allclose(models.actor(input_ids=IDS).logits, want, atol=1e-3)
        workers.pull_into(models)
        torch.testing.assert_close(models.actor(input_ids=IDS).logits, want)


def test_rank0_checkpoint_restores_in_one_process(lora_workers, tmp_path):
    cfg, workers = lora_workers
    path = tmp_path / "checkpoint.pt"
    workers.save_checkpoint(path, iteration=3, kl_coef=0.07, counters={"skipped": 1, "consecutive": 0})
    models = build_models(cfg, tmp_path, torch.device("cpu"))
    learners = build_learners(models, cfg.rl)
    state = load_checkpoint(path, *checkpoint_parts(models, learners))
    assert (state["iteration"], state["kl_coef"], state["counters"]["skipped"]) == (3, 0.07, 1)
    want = ray.get(workers.workers[0].__ray_call__.remote(actor_logits, IDS))
    with torch.no_grad():
        torch.testing.assert_close(models.actor.eval()(input_ids=IDS).logits, want)
    assert workers.load_checkpoint(path)["iteration"] == 3  # every rank restores the same file

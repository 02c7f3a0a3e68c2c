import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parents[1]

# Tiny settings of the default task: a 2-layer, 64-dim GPT-2 on 400 reviews trains in seconds.
TINY = ["data.num_reviews=400", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.max_length=96",
        "sft.steps=6", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=3", "sft.eval_samples=4",
        "rm.steps=4", "rm.batch_size=8", "rm.micro_batch_size=4", "rm.eval_every=2", "rm.num_pairs=64",
        "run.quiet=true"]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["RLFUSE_CACHE"] = str(tmp_path_factory.mktemp("rlfuse-cache"))
    os.environ.setdefault("CI", "true")
    yield


@pytest.fixture(scope="session")
def tiny_task():
    from rlfuse.data.task import build_default_task

    return build_default_task(400, 0, 2, 64, 2, log=lambda *_: None)

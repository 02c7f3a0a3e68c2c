"""Token-budget micro-batches (rl.micro_batch_tokens): the packing, the forward-token count it packs by, that every
sample is in exactly one micro-batch with a prompt's samples together, the data-parallel fallback, and that the
update's inner loop reads nothing back to the host per micro-batch."""

import torch

from rlfuse.config import load_config
from rlfuse.data.collate import pack_by_tokens, prompt_runs
from rlfuse.rollout.fusion import Experience
from rlfuse.models.forward import forward_tokens
from rlfuse.learn.learners import Learner
from rlfuse.learn.batches import micro_batch_indices, rank_slots
from rlfuse.learn.update import BadSteps, optimise


def test_prompt_runs_by_hand():
    assert prompt_runs([4, 5, 0, 1, 2], [0, 0, 1, 1, 2, 2]) == [[4, 5], [0, 1], [2]]
    assert prompt_runs([], []) == []


def test_pack_by_tokens_by_hand():
    ten_each = lambda idx: 10 * len(idx)
    assert pack_by_tokens([[0, 1], [2], [3, 4, 5]], ten_each, 30) == [[0, 1, 2], [3, 4, 5]]
    # [3, 4, 5] alone is over 20: split, its samples fill the room left
    assert pack_by_tokens([[0, 1], [2], [3, 4, 5]], ten_each, 20) == [[0, 1], [2, 3], [4, 5]]
    assert pack_by_tokens([[0], [1]], lambda idx: 99, 10) == [[0], [1]]  # over budget alone: one each


def test_forward_tokens_by_hand():
    p, q = [1, 2, 3, 4], [5, 6]
    # unshared: 3 rows x longest sequence (4 + 3)
    assert forward_tokens([p, p, q], [[7], [7, 8, 9], [7, 8]], False) == 3 * 7
    # shared: 2 distinct prompts x 4 + the continuations (responses less their last token: 0, 2, 1) packed by
    # prompt, p's two in one row and q's in another, both 2 wide (3 rows x 2 padded)
    assert forward_tokens([p, p, q], [[7], [7, 8, 9], [7, 8]], True) == 2 * 4 + 2 * 2
    # continuations of equal lengths gain nothing packed: 3 rows x 2
    assert forward_tokens([p, p, q], [[7, 8, 9]] * 3, True) == 2 * 4 + 3 * 2
    assert forward_tokens([p, q], [[7], [7, 8]], True) == 2 * 5  # nothing repeats: the full forward, 2 x (4 + 1)


def experience(prompt_lens, response_lens, k) -> Experience:
    prompts = [[1] * prompt_lens[i // k] for i in range(len(response_lens))]
    responses = [[2] * n for n in response_lens]
    T, n = max(response_lens), len(response_lens)
    mask = torch.zeros(n, T)
    for i, r in enumerate(response_lens):
        mask[i, :r] = 1
    return Experience(prompts, responses, torch.arange(n) // k, torch.zeros(n), torch.zeros(n, T), torch.zeros(n, T),
                      None, mask, ["eos"] * n)


def test_token_budget_micro_batches_keep_prompts_together_within_budget():
    exp = experience([5, 30, 10, 2], [3, 9, 1, 4, 20, 2, 6, 6, 1, 1, 12, 2], k=3)
    mini = [6, 7, 8, 0, 1, 2, 9, 10, 11, 3, 4, 5]  # grouped by prompt, as minibatches() orders grouped algorithms
    for shared in (False, True):
        micro = micro_batch_indices(exp, mini, 4, tokens=150, shared=shared)
        assert sorted(i for m in micro for i in m) == sorted(mini)
        cost = lambda m: forward_tokens([exp.prompt_ids[i] for i in m], [exp.response_ids[i] for i in m], shared)
        assert all(cost(m) <= 150 or len(m) == 1 for m in micro)
        groups = [{i // 3 for i in m} for m in micro]
        # a prompt's samples are split only where together they exceed the budget (prompt 1: 3 x (30 + 20) = 150
        # unshared fits; prompt 1 shared and everything else fits too)
        assert all(sum(i // 3 == g for m in micro for i in m) == 3 for g in range(4))
        assert all(len(g) >= 1 for g in groups) and sum(len(g) for g in groups) == 4
    # two ranks, a budget that packs everything into one micro-batch: cut into one per rank instead
    assert len(micro_batch_indices(exp, mini, 12, world=2, tokens=10_000)) == 2


def test_micro_batches_by_count_group_a_prompts_samples_by_length():
    """By count, each prompt's samples are cut shortest first (the runs of one prompt in their order), so the short
    replies of a prompt share a micro-batch and pad to each other, not to its longest: by hand."""
    exp = experience([5, 7], [9, 1, 30, 2, 5, 4, 3, 8], k=4)
    mini = [4, 5, 6, 7, 0, 1, 2, 3]  # prompt 1's samples, then prompt 0's
    assert micro_batch_indices(exp, mini, 2) == [[6, 5], [4, 7], [1, 3], [0, 2]]
    assert micro_batch_indices(exp, mini, 3) == [[6, 5, 4], [7, 1, 3], [0, 2]]  # a micro-batch across two prompts
    # the longest response padded to, summed over micro-batches: 4 + 8 + 2 + 30 against 5 + 8 + 9 + 30 in mini's order
    padded = lambda micro: sum(len(m) * max(len(exp.response_ids[i]) for i in m) for m in micro)
    assert padded(micro_batch_indices(exp, mini, 2)) < padded([mini[s: s + 2] for s in range(0, 8, 2)])
    assert micro_batch_indices(exp, [2, 1, 0], 2) == [[1, 0], [2]]  # one prompt, ties none
    # two ranks keep mini's order: by length, rank 1 (micro-batches 1 and 3) would get both prompts' long replies
    assert micro_batch_indices(exp, mini, 2, world=2) == [mini[s: s + 2] for s in range(0, 8, 2)]
    tie = experience([5], [4, 4, 2], k=3)
    assert micro_batch_indices(tie, [1, 0, 2], 3) == [[2, 1, 0]]  # equal lengths keep the order given


def test_no_host_read_per_micro_batch(monkeypatch):
    """optimise's inner loop (micro-batches of one mini-batch) reads no tensor back to the host: the number of reads
    is the same for 1 and for 8 micro-batches (a NaN check per micro-batch would add one each)."""
    reads = {"n": 0}
    for name in ("__bool__", "item", "__float__", "__int__", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **kw):
            reads["n"] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    w = torch.nn.Parameter(torch.ones(3))
    module = torch.nn.Module()
    module.w = w
    opt = torch.optim.SGD([w], lr=0.1)
    learner = Learner(module, opt, torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 0))
    exp = experience([2], [1, 2, 3, 4, 1, 2, 3, 4], k=8)
    loss_of = lambda idx, share: ((w * len(idx)).sum() * share["token"], {"x": w.sum()})
    counts = []
    for micro in (8, 1):
        rl = load_config(None, ["rl.algo=grpo", "rl.k=8", "rl.prompts_per_iter=1", "rl.mini_batch_size=8",
                                f"rl.micro_batch_size={micro}", "rl.grad_clip=0"]).rl
        before = reads["n"]
        optimise([learner], [list(range(8))], exp, micro, loss_of, rl, BadSteps())
        counts.append(reads["n"] - before)
    assert counts[0] == counts[1], counts


def test_rank_slots_pad_the_last_slot_with_the_first_micro_batch():
    every = [[0, 1], [2, 3], [4, 5]]
    assert rank_slots(every, 2) == [[[0, 1], [2, 3]], [[4, 5], [0, 1]]]
    assert rank_slots(every, 1) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    for rank in range(2):  # the real (non-padding) ones are micro_batches' [rank::world]
        assert [slot[rank] for slot in rank_slots(every, 2)][:len(every[rank::2])] == every[rank::2]

"""Per-sample random streams (rollout/streams.py): a pure function of (seed, prompt id, sample index, position)."""

import torch

from rlfuse.rollout.streams import sample_uniforms


def reference_uniform(seed: int, prompt_id: int, sample_index: int, position: int) -> float:
    """The same hash written out on Python ints, word by word: splitmix32's golden increment, then the finaliser
    [16 21f0aaad 15 735a2d97 15]; the seed as two 32-bit words, low first; the top 24 bits as the uniform."""
    m = 2 ** 32 - 1
    h = 0
    seed %= 2 ** 64
    for word in (seed % 2 ** 32, seed // 2 ** 32, prompt_id, sample_index, position):
        x = ((h ^ word) + 0x9E3779B9) % 2 ** 32
        x ^= x >> 16
        x = x * 0x21F0AAAD & m
        x ^= x >> 15
        x = x * 0x735A2D97 & m
        h = x ^ (x >> 15)
    return (h >> 8) / 2 ** 24


def draw(seed, pids, js, pos):
    return sample_uniforms(seed, torch.tensor(pids), torch.tensor(js), torch.tensor(pos))


def test_values_by_hand():
    keys = [(0, 0, 0, 0), (0, 3, 1, 7), (2 ** 40 + 5, 3, 1, 7), (-1, 1, 2, 3), (12345 * 1_000_003 + 9, 40, 3, 200)]
    u = sample_uniforms(0, torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    assert u.dtype == torch.float32 and u.item() == 4338807 / 2 ** 24  # the all-zero key is not 0
    for seed, p, j, t in keys:
        assert draw(seed, [p], [j], [t]).item() == reference_uniform(seed, p, j, t)


def test_independent_of_row_order_and_batch_composition():
    g = torch.Generator().manual_seed(0)
    pids, js, pos = torch.randint(0, 50, (200,), generator=g), torch.randint(0, 8, (200,), generator=g), \
        torch.randint(0, 100, (200,), generator=g)
    whole = sample_uniforms(7, pids, js, pos)
    perm = torch.randperm(200, generator=g)
    assert torch.equal(sample_uniforms(7, pids[perm], js[perm], pos[perm]), whole[perm])
    for i in (0, 17, 199):  # one row alone
        assert torch.equal(sample_uniforms(7, pids[i:i + 1], js[i:i + 1], pos[i:i + 1]), whole[i:i + 1])


def test_every_key_word_changes_the_draw():
    base = draw(5, [3], [1], [7])
    for other in (draw(6, [3], [1], [7]), draw(5 + 2 ** 32, [3], [1], [7]), draw(5, [4], [1], [7]),
                  draw(5, [3], [2], [7]), draw(5, [3], [1], [8]), draw(5, [1], [3], [7])):
        assert other.item() != base.item()
    # a trainer-sized seed (seed * 1_000_003 + iteration) differs from its 32-bit truncation
    big = 12345 * 1_000_003 + 3  # > 2**32
    assert draw(big, [0], [0], [0]).item() != draw(big % 2 ** 32, [0], [0], [0]).item()


def test_roughly_uniform_along_and_across_streams():
    n = 100_000
    along = draw(1, [0] * n, [0] * n, list(range(n)))  # one stream, consecutive positions
    across = draw(1, [i // 16 for i in range(n)], [i % 16 for i in range(n)], [0] * n)  # many streams, position 0
    for u in (along, across):
        assert u.min() >= 0 and u.max() < 1
        assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
        counts = torch.histc(u, bins=20, min=0, max=1)
        assert (counts - n / 20).abs().max() < 5 * (n / 20) ** 0.5  # ~5 sigma of a binomial count
        assert len(torch.unique(u)) > 0.99 * n
    # neighbouring positions are not correlated
    x, y = along[:-1] - 0.5, along[1:] - 0.5
    assert abs((x * y).mean().item()) < 0.002

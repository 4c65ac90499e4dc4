"""Next-token selection under a request's sampling settings."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.request import Request
from kvboost_rag.sampling import select_token

CPU = torch.device("cpu")


def logits(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def samples(params, scores, n=40):
    gen = params.generator(CPU)
    return [select_token(scores, params, gen) for _ in range(n)]


# -- selection ---------------------------------------------------------------


def test_greedy_is_argmax_and_needs_no_generator():
    params = Request("p", temperature=0.0)
    assert params.generator(CPU) is None
    for seed in range(10):
        scores = logits(seed)
        assert select_token(scores, params, None) == int(torch.argmax(scores))


def test_greedy_picks_a_known_token():
    scores = torch.tensor([0.1, 5.0, -2.0, 4.9])
    assert select_token(scores, Request("p"), None) == 1


def test_top_k_one_is_argmax():
    params = Request("p", temperature=1.0, top_k=1, seed=0)
    scores = torch.zeros(50)
    scores[17] = 0.5  # barely ahead: plain sampling would often pick another token
    assert set(samples(params, scores, 100)) == {17}


def test_tiny_top_p_is_argmax():
    params = Request("p", temperature=1.0, top_p=1e-6, seed=0)
    scores = torch.zeros(50)
    scores[33] = 0.5
    assert set(samples(params, scores, 100)) == {33}


def test_top_k_restricts_to_the_k_best():
    scores = torch.tensor([3.0, 2.9, 2.8, 0.0, 0.0, 0.0, 0.0, 0.0])
    params = Request("p", temperature=5.0, top_k=3, seed=1)
    picked = samples(params, scores, 200)
    assert set(picked) == {0, 1, 2}


def test_top_k_larger_than_vocab_is_fine():
    scores = torch.tensor([1.0, 2.0, 3.0])
    params = Request("p", temperature=1.0, top_k=1000, seed=0)
    assert set(samples(params, scores, 200)) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.4, 0.3, 0.2, 0.1: top_p=0.5 keeps the first two (0.4 < 0.5 <= 0.7)
    scores = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    params = Request("p", temperature=1.0, top_p=0.5, seed=2)
    assert set(samples(params, scores, 300)) == {1, 3}
    params = Request("p", temperature=1.0, top_p=0.75, seed=2)
    assert set(samples(params, scores, 300)) == {1, 2, 3}


def test_temperature_sampling_covers_more_than_argmax():
    scores = torch.zeros(10)
    params = Request("p", temperature=1.0, seed=5)
    assert len(set(samples(params, scores, 200))) > 5


def test_same_seed_same_samples():
    scores = torch.zeros(100)
    params = Request("p", temperature=1.0, seed=1234)
    first = samples(params, scores)
    assert samples(params, scores) == first
    assert samples(Request("p", temperature=1.0, top_p=0.9, top_k=50, seed=1234), scores) == samples(
        Request("p", temperature=1.0, top_p=0.9, top_k=50, seed=1234), scores
    )


def test_different_seeds_usually_differ():
    scores = torch.zeros(100)
    runs = {tuple(samples(Request("p", temperature=1.0, seed=s), scores, 20)) for s in range(5)}
    assert len(runs) == 5


def test_unseeded_generators_differ():
    scores = torch.zeros(100)
    params = Request("p", temperature=1.0)
    assert samples(params, scores, 20) != samples(params, scores, 20)


def test_unseeded_generator_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    Request("p", temperature=1.0).generator(CPU)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1e-300},
        {"temperature": 1e-40},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1e-300, "top_p": 0.5, "top_k": 3},
    ],
)
def test_extreme_settings_sample_the_top_token_instead_of_failing(settings):
    scores = logits(seed=4)
    request = Request("p", seed=0, **settings)
    assert samples(request, scores, n=5) == [int(scores.argmax())] * 5

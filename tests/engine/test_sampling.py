import doctest

import pytest
import torch
from specfleet_bench.sampler import full_sort_top_p
from specfleet_engine import sampling
from specfleet_engine.sampling import SamplingParams, logits_to_probs


def test_docstring_examples():
    assert doctest.testmod(sampling, extraglobs={"torch": torch}).failed == 0


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 crosses 0.7
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("vocab", [111, 49152])  # the full sort, and the partial top-k first
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(vocab):
    # valid input (in (0, 1]) that rounds to 0 in float32: the fuzzed worker drew 5.4e-61
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=5.4e-61))
    assert not p.isnan().any()
    assert (p > 0).sum(-1).tolist() == [1, 1, 1] and p.argmax(-1).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", dict(max_tokens=0)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-1)),
])
def test_validate_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_sample_from_draws_each_row_from_its_distribution_and_never_a_zero():
    # vocabulary 111 with a third of it masked (as top-k / top-p leave it); 20000 draws per row
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, 111, generator=g) * 2, dim=-1)
    p[0, ::3] = 0.0
    p[1, 50:] = 0.0
    p = p / p.sum(-1, keepdim=True)
    draws = torch.stack([sampling.sample_from(p, g) for _ in range(20000)])
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=111).double() / draws.shape[0]
        assert float(freq[p[row] == 0].sum()) == 0.0
        assert 0.5 * float((freq - p[row].double()).abs().sum()) < 0.03  # TV: ~0.018 expected by chance


def test_a_draw_at_the_very_top_of_the_cdf_lands_on_the_last_token_with_mass(monkeypatch):
    # a uniform whose product with the total rounds up to the total passes every cumulative sum
    p = torch.tensor([[0.2, 0.8, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, 1, dtype=torch.float64))
    assert sampling.sample_from(p, None).tolist() == [1]


def test_a_draw_of_zero_skips_the_leading_tokens_without_mass(monkeypatch):
    p = torch.tensor([[0.0, 0.0, 0.3, 0.7]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1, 1, dtype=torch.float64))
    assert sampling.sample_from(p, None).tolist() == [2]


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])  # 0.3: flat, the candidates hold too little mass
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_among_the_candidates_keeps_what_a_full_sort_keeps(scale, top_p):
    g = torch.Generator().manual_seed(int(scale * 10) + int(top_p * 100))
    probs = torch.softmax(torch.randn(3, 5000, generator=g) * scale, dim=-1)
    got, want = sampling.top_p_filter(probs, top_p), full_sort_top_p(probs, top_p)  # the rule over all, sorted
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-7)


def test_top_p_falls_back_to_the_full_sort_where_the_candidates_fall_short(monkeypatch):
    probs = torch.full((1, 3000), 1 / 3000)  # 1024 candidates hold a third of the mass
    calls = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: calls.append(1) or real_sort(*a, **k))
    got = sampling.top_p_filter(probs, 0.9)
    assert calls == [1] and 2700 <= int((got > 0).sum()) <= 2701  # 0.9 of the mass, give or take rounding
    calls.clear()
    got = sampling.top_p_filter(probs, 0.3)
    assert calls == [] and 900 <= int((got > 0).sum()) <= 901

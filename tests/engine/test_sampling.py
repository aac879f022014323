import doctest

import pytest
import torch

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

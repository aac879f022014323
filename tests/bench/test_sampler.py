"""specfleet_bench.sampler on the tiny model: the old sampler is swapped in where sample_from is
called and put back, and a batch decodes under each."""

import pytest

from specfleet_bench import sampler
from specfleet_engine import sampling
from specfleet_engine.kernels import rejection
from specfleet_worker.testing import tiny_engine


def test_the_race_is_swapped_in_everywhere_and_restored():
    engine = tiny_engine(k_policy="adaptive")
    new = sampling.sample_from, sampling.top_p_filter
    with sampler.using("old"):
        assert sampling.sample_from is sampler.race and rejection.sample_from is sampler.race
        assert sampling.top_p_filter is sampler.full_sort_top_p
        tokens, seconds = sampler.decode(engine, [[11, 3, 27, 8, 40, 2, 19]] * 3, "ngram", 0.8, 12, seed=1, top_p=0.9)
    assert (sampling.sample_from, sampling.top_p_filter) == new and rejection.sample_from is new[0]
    assert tokens == 36 and seconds > 0


@pytest.mark.parametrize("argv, words", [(["--batches", "1,x"], "--batches"), (["--temperature", "0"], "--temperature"),
                                         (["--rounds", "0"], "--rounds"), (["--top-p", "0"], "--top-p"),
                                         (["--top-p", "a"], "--top-p")])
def test_bad_arguments_exit_2_naming_them(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        sampler.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err

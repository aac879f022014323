"""`specfleet bench select`'s configs and ratios (the fleet runs are episodes: tests/local)."""
from __future__ import annotations

import doctest

from specfleet_bench import method_select
from specfleet_bench.method_select import build_parser, main, spec


def test_the_module_doctests_pass():
    assert doctest.testmod(method_select).failed == 0


def test_a_k_suffix_turns_on_k_tuning_and_keeps_the_config():
    args = build_parser().parse_args([])
    for config in ("self", "ngram", "eagle"):
        plain, tuned = spec(config, args)["spec"], spec(config + "+k", args)["spec"]
        assert plain["speculation"]["kTuning"] == {"enabled": False}
        assert tuned["speculation"]["kTuning"] == {"enabled": True}
        assert {k: v for k, v in tuned.items() if k != "speculation"} == {k: v for k, v in plain.items()
                                                                            if k != "speculation"}
    assert spec("self+k", args)["spec"]["routing"]["select"]["enabled"] is True
    assert spec("ngram+k", args)["spec"]["draft"] == {"method": "ngram"}


def test_an_unknown_config_exits_2_naming_it(capsys):
    assert main(["--configs", "ngram,fast+k"]) == 2
    assert "fast+k" in capsys.readouterr().err
    assert main(["--configs", "table+k"]) == 2  # the table needs --table

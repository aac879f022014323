"""`specfleet bench --configs`: PRECISION/METHOD[@KPOLICY], every served K policy by name."""
import pytest

from specfleet_api.enums import SERVED_K_POLICIES
from specfleet_bench.spec_bench import parse_configs


def test_every_served_k_policy_is_a_config_suffix():
    configs = parse_configs(",".join(f"fp32/eagle@{p}" for p in SERVED_K_POLICIES) + ",fp32/eagle-tree@confidence")
    assert configs == [("fp32", "none"), *(("fp32", f"eagle@{p}") for p in SERVED_K_POLICIES),
                       ("fp32", "eagle-tree@confidence")]


@pytest.mark.parametrize("bad", ["fp32/eagle@eagle2", "fp32/none@entropy", "hf/plain@confidence"])
def test_a_bad_k_policy_suffix_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="@KPOLICY must be one of adaptive, fixed, confidence, entropy"):
        parse_configs(bad)

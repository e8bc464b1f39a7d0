"""pic_recompute_ratio (selective recompute of position-independent loads): default and checks."""

import pytest

from vllm_kvbm_plugin.config import KVBMConfig


def test_default_is_loads_alone():
    assert KVBMConfig.from_extra({}).pic_recompute_ratio == 0
    assert KVBMConfig.from_extra({"pic_recompute_ratio": 0.15}).pic_recompute_ratio == 0.15


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.2", True, None])
def test_ratio_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="pic_recompute_ratio must be a number in \\[0, 1\\]"):
        KVBMConfig.from_extra({"pic_recompute_ratio": bad})

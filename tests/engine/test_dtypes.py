"""The one table of served dtypes (common.engine.dtypes): names and torch dtypes map both ways,
anything else is refused by the checked forms, and a segment key (a content address) names a
dtype as given, a torch dtype and its name alike."""
import pytest
import torch

from common.engine.dtypes import DTYPE_NAMES, check_dtype_name, dtype_name, name_of, torch_dtype
from common.engine.fingerprint import segment_key
from common.engine.pic.entry import dtype_name as entry_dtype_name


def test_names_and_torch_dtypes_map_both_ways():
    assert set(DTYPE_NAMES) == {"float32", "bfloat16", "float16"}
    for name in DTYPE_NAMES:
        dtype = torch_dtype(name)
        assert isinstance(dtype, torch.dtype) and torch.empty(0, dtype=dtype).dtype == dtype
        assert dtype_name(dtype) == name == dtype_name(name) == name_of(dtype) == entry_dtype_name(dtype)


@pytest.mark.parametrize("bad", ["float64", "int8", "fp32", "", torch.float64, torch.int32])
def test_other_dtypes_are_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        dtype_name(bad)
    if isinstance(bad, str):
        with pytest.raises(ValueError):
            check_dtype_name(bad)
        with pytest.raises(ValueError):
            torch_dtype(bad)


def test_a_segment_key_names_the_dtype_as_given():
    ids = [3, 1, 4, 1, 5]
    assert segment_key("fp", 8, torch.bfloat16, ids) == segment_key("fp", 8, "bfloat16", ids)
    assert segment_key("fp", 8, "float32", ids) != segment_key("fp", 8, "bfloat16", ids)
    # an unserved dtype (a forged entry header) still gets a key, one no served entry has
    assert segment_key("fp", 8, "float64", ids) not in {segment_key("fp", 8, n, ids) for n in DTYPE_NAMES}

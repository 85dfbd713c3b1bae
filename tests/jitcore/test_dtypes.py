import pytest
import torch

from jitcore import dlpack, dtypes


@pytest.mark.parametrize("dtype", dtypes.ALL, ids=lambda d: d.name)
def test_table_matches_what_torch_exports(dtype):
    exported = dlpack.read_capsule(torch.utils.dlpack.to_dlpack(torch.empty(2, dtype=dtype.torch_dtype)))
    assert (exported.dtype_code, exported.dtype_bits, exported.dtype_lanes) == dtype.dlpack
    assert torch.empty(0, dtype=dtype.torch_dtype).element_size() == dtype.itemsize


def test_fp8_variants_have_distinct_names_and_codes():
    fp8 = [d for d in dtypes.ALL if d.kind == "fp8"]
    assert len({d.name for d in fp8}) == len(fp8) >= 4
    assert len({d.dlpack for d in fp8}) == len(fp8)


def test_unknown_dtype_is_a_clear_type_error():
    with pytest.raises(TypeError, match="quint8 is not supported"):
        dtypes.from_torch(torch.quint8)

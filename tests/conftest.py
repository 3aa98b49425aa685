import pytest

import pyperm

requires_cuda = pytest.mark.skipif(
    not pyperm.cuda_available(), reason=f"needs a CUDA device and pyperm's CUDA build: {pyperm.cuda_unavailable_reason()}"
)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def device(request):
    """CPU always; CUDA cases show as skipped on machines without a GPU."""
    return request.param

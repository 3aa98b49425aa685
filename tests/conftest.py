import pytest

import pyperm

requires_cuda = pytest.mark.skipif(
    not pyperm.cuda_available(), reason=f"needs a CUDA device and pyperm's CUDA build: {pyperm.cuda_unavailable_reason()}"
)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def device(request):
    """CPU always; CUDA cases show as skipped on machines without a GPU."""
    return request.param


@pytest.fixture(scope="session")
def pipelines(tmp_path_factory):
    """Two tiny random SD-1.x pipelines of different seeds (diffusers folders written once for the
    session by pyperm.testing.tiny_pipeline; the tests that share them never write into them)."""
    from pyperm.testing import tiny_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    tiny_pipeline(root / "pa", seed=0)
    tiny_pipeline(root / "pb", seed=1)
    return root / "pa", root / "pb"

import pytest

import pyperm
from pyperm._optional_imports import prepare_hf_import

# diffusers and transformers import torchvision, which fails over a torch it was not built for:
# import it the tolerant way once, as the command line does, so that every test file runs the
# same alone as in the whole suite (tests/test_cli_fresh_process.py checks the command itself).
prepare_hf_import()

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

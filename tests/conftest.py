"""Shared test configuration: the `cuda` marker skips without a GPU; seeded generators."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A seeded CPU generator, so every test draws the same inputs run to run."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings():
    """Each test sees its own fallback warnings and back-end resolution (tests swap build states)."""
    import nvfp4_dit
    from nvfp4_dit import planner

    nvfp4_dit.reset_fallback_warnings()
    planner.forget_resolved()
    yield


@pytest.fixture(scope="session")
def cuda_device():
    """The CUDA device, for GPU tests: skips without a GPU, fails if the kernel does not load."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import nvfp4_dit

    dev = torch.device("cuda")
    if "cuda" not in nvfp4_dit.available_backends(dev):
        pytest.fail("the CUDA back-end does not load on this GPU")
    return dev

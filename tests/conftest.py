import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def cuda_ready() -> bool:
    from ddo_blocks import _native

    return _native.cuda_unavailable_reason() is None and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run by hand on the GPU machine (see docs/gpu.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def flux():
    from ddo_blocks.tiny import tiny_flux_transformer

    return tiny_flux_transformer()


@pytest.fixture
def vae():
    from ddo_blocks.tiny import tiny_autoencoder_kl

    return tiny_autoencoder_kl()

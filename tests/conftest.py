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


@pytest.fixture(scope="session")
def flux_checkpoints(tmp_path_factory):
    """A tiny bf16 Flux transformer saved twice by diffusers: ``single`` (one file) and ``sharded``
    (three shards + index). Returns ``(root, model, inputs, reference output)``."""
    from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

    model = tiny_flux_transformer(dtype=torch.bfloat16)
    x = flux_inputs(model)
    with torch.no_grad():
        ref = model(**x)[0]
    root = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    return root, model, x, ref

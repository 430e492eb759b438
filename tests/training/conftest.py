"""What the update-side tests share: the tiny model of each family whose passes they compare."""

from __future__ import annotations

import pytest

from lit_offpolicy.models import create_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def model_dir(request, tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model of each family that packed and shared-prefix rows run (seed 0), once per module."""
    if request.param == "llama":
        return tiny_model_dir
    return str(create_tiny_model(tmp_path_factory.mktemp(request.param) / "m", seed=0, arch=request.param))

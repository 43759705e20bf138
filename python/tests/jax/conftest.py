"""The JAX tests run where jax is installed: .ci/run's jax step installs it and sets
XENT_REQUIRE_JAX=1, so there a missing jax (or a package built without xent.jax) fails the
collection. Elsewhere (the torch step's environment, which has no jax) they are not collected.
The `device` fixture runs a test on the CPU and, when jax sees one, on a GPU.
"""

import importlib.util
import os

if os.environ.get("XENT_REQUIRE_JAX") != "1" and importlib.util.find_spec("jax") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import jax
    import pytest

    try:
        _GPUS = jax.devices("gpu")
    except RuntimeError:
        _GPUS = []

    @pytest.fixture(
        params=[
            pytest.param("cpu", id="cpu"),
            pytest.param(
                "gpu",
                id="gpu",
                marks=pytest.mark.skipif(not _GPUS, reason="no GPU visible to jax"),
            ),
        ]
    )
    def device(request):
        return jax.devices(request.param)[0]

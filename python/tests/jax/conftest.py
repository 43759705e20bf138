"""The JAX tests run where jax is installed: .ci/run's jax step installs it and sets
XENT_REQUIRE_JAX=1, so there a missing jax (or a package built without xent.jax) fails the
collection. Elsewhere (the torch step's environment, which has no jax) they are not collected.
The `device` fixture runs a test on the CPU and, when jax sees one, on a GPU.

XLA's CPU client is started with 4 devices (--xla_force_host_platform_device_count, set here
before jax is imported) for the vocab-parallel tests' meshes; the other tests use the first.
"""

import importlib.util
import os

if os.environ.get("XENT_REQUIRE_JAX") != "1" and importlib.util.find_spec("jax") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    _FLAG = "--xla_force_host_platform_device_count"
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=4".strip()

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

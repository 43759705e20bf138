"""The JAX tests run where jax is installed: .ci/run's jax step installs it and sets
XENT_REQUIRE_JAX=1, so there a missing jax (or a package built without xent.jax) fails the
collection. Elsewhere (the torch step's environment, which has no jax) they are not collected.
"""

import importlib.util
import os

if os.environ.get("XENT_REQUIRE_JAX") != "1" and importlib.util.find_spec("jax") is None:
    collect_ignore_glob = ["test_*.py"]

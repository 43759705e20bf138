"""xent.jax's CUDA handlers inside XLA's command buffers (CUDA graphs): a child process whose XLA
captures custom calls (--xla_gpu_enable_command_buffer with CUSTOM_CALL, every graph size) runs
each handler's call jitted, checks that the compiled HLO holds the handlers inside a command
buffer, and compares the results of two replays on fresh inputs with the CPU handlers' (the
workspace result is zero-filled and the cuBLAS handle bound by every replay, not by the capture
alone). Needs a GPU that jax sees and the package's CUDA handlers."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

import xent.jax as xj

try:
    _GPUS = jax.devices("gpu")
except RuntimeError:
    _GPUS = []

pytestmark = [
    pytest.mark.skipif(not _GPUS, reason="no GPU visible to jax"),
    pytest.mark.skipif(not xj.with_cuda, reason="xent.jax was built without its CUDA handlers"),
]

_CHILD = textwrap.dedent(
    """
    import re, sys
    import jax, jax.numpy as jnp, numpy as np
    import xent.jax as xj

    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]

    def close(a, b, tol):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))

    def in_command_buffer(compiled, target):
        # The computations XLA's command-buffer scheduling made, and whether one calls target.
        text = compiled.as_text()
        bodies = re.findall(r"\\n(%?command_buffer[^\\n]*\\{.*?\\n\\})", text, re.S)
        return any(target in b for b in bodies)

    def run(name, f, make, targets, tol=2e-5):
        g = jax.jit(f)
        for seed in (0, 1):  # the second call replays the graph on new inputs
            args = make(seed)
            got = g(*jax.device_put(args, gpu))
            want = jax.jit(f)(*jax.device_put(args, cpu))
            jax.tree.map(lambda a, b: close(a, b, tol), got, want)
        compiled = g.lower(*jax.device_put(make(0), gpu)).compile()
        missing = [t for t in targets if not in_command_buffer(compiled, t)]
        if missing:  # the computations XLA made, to see where the calls went
            print("\\n".join(l for l in compiled.as_text().splitlines() if l.endswith("{")))
        assert not missing, f"{name}: not in a command buffer: {missing}"
        print("captured", name)

    V, N, D = 5003, 37, 64

    def ce(seed):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        return 3 * jax.random.normal(k1, (N, V)), jax.random.randint(k2, (N,), 0, V)

    for red in ("mean", "sum", "none"):
        kw = dict(reduction=red, label_smoothing=0.1, z_loss=1e-3)
        f = lambda x, y, kw=kw: jax.value_and_grad(
            lambda x: xj.cross_entropy(x, y, **kw).sum())(x)
        targets = ["xent_cross_entropy_fwd_bwd", "xent_scale_grad"] if red != "none" else [
            "xent_cross_entropy_fwd", "xent_cross_entropy_bwd"]
        run("cross_entropy " + red, f, ce, targets)

    def lin(seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 4)
        return (jax.random.normal(ks[0], (N, D)), 0.2 * jax.random.normal(ks[1], (V, D)),
                jax.random.normal(ks[2], (V,)), jax.random.randint(ks[3], (N,), 0, V))

    for red in ("mean", "none"):
        f = lambda h, w, b, y, red=red: jax.value_and_grad(
            lambda h, w, b: xj.linear_cross_entropy(h, w, y, b, reduction=red).sum(),
            argnums=(0, 1, 2))(h, w, b)
        targets = (["xent_linear_cross_entropy_fwd_bwd"] if red != "none" else
                   ["xent_linear_cross_entropy_fwd", "xent_linear_cross_entropy_bwd"])
        # cuBLAS's float32 GEMMs may round differently from the CPU's: a looser tolerance, far
        # below what a workspace that a replay did not find again would give.
        run("linear_cross_entropy " + red, f, lin, targets, tol=1e-3)

    # The vocab-parallel handlers, one device (a mesh of one: the all-gather is the identity).
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array([gpu]), ("v",))
    body = lambda x, y: xj.vocab_parallel_cross_entropy(x, y, axis_name="v", z_loss=1e-3)
    sm = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "v"), P()), out_specs=P())
    f = lambda x, y: jax.value_and_grad(sm)(x, y)
    g = jax.jit(f)
    for seed in (0, 1):
        x, y = ce(seed)
        got = g(*jax.device_put((x, y), gpu))
        want = jax.jit(jax.value_and_grad(lambda x: xj.cross_entropy(x, y, z_loss=1e-3)))(
            jax.device_put(x, cpu))
        jax.tree.map(lambda a, b: close(a, b, 2e-5), got, want)
    compiled = g.lower(*jax.device_put(ce(0), gpu)).compile()
    for t in ("xent_vocab_parallel_records", "xent_vocab_parallel_merge",
              "xent_vocab_parallel_backward"):
        assert in_command_buffer(compiled, t), f"vocab-parallel: not in a command buffer: {t}"
    print("captured vocab_parallel")
    """
)


def test_handlers_in_cuda_graphs_match_the_cpu():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
        + " --xla_gpu_graph_min_graph_size=1"
    ).strip()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("captured") == 6, done.stdout

"""xent.jax's CUDA handlers inside XLA's command buffers (CUDA graphs): a child process whose XLA
captures custom calls (--xla_gpu_enable_command_buffer with CUSTOM_CALL, every graph size) runs
each handler's call jitted, checks that XLA put the handlers inside a command buffer, and compares
the results of two replays on fresh inputs with the CPU handlers' (the workspace result is
zero-filled and the cuBLAS handle bound by every replay, not by the capture alone). Needs a GPU
that jax sees and the package's CUDA handlers.

Where XLA forms command buffers decides where the check looks. An XLA with the HLO pass
CommandBufferScheduling outlines them as command_buffer computations of the compiled HLO. The XLA
of jaxlib 0.11 has no such pass: its CommandBufferConversionPass
(xla/backends/gpu/runtime/command_buffer_conversion_pass.cc) groups the thunks of the finished
executable (a custom call's when its FFI handler declares kCmdBufferCompatible), so the compiled
HLO shows none, and the check reads the thunk sequence that XLA dumps after its thunk passes."""

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
    import glob, os, re, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    import xent.jax as xj

    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]

    def close(a, b, tol):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))

    def custom_call_thunks(thunks):
        # (inside, outside) a command buffer: the kCustomCall thunks of XLA's thunk-sequence dump,
        # whose lines are "<indent><id>: <kind> ...", a command buffer's thunks indented under it.
        inside = outside = 0
        in_buffer = False
        for indent, kind in re.findall(r"^( *)\\d+: (\\w+)", thunks, re.M):
            if not indent:
                in_buffer = kind == "kCommandBuffer"
            if kind == "kCustomCall":
                inside, outside = (inside + 1, outside) if indent and in_buffer else (
                    inside, outside + 1)
        return inside, outside

    def check_captured(name, g, args, targets):
        with tempfile.TemporaryDirectory() as dump:
            compiled = g.lower(*args).compile({"xla_dump_to": dump})
            text = compiled.as_text()
            calls = re.findall(r'custom_call_target="(xent_\\w+)"', text)
            absent = [t for t in targets if t not in calls]
            assert not absent, f"{name}: not in the compiled HLO: {absent}"
            bodies = re.findall(r"\\n(%?command_buffer[^\\n]*\\{.*?\\n\\})", text, re.S)
            if bodies:  # XLA's HLO pass made them
                missing = [t for t in targets if not any(t in b for b in bodies)]
                shown = "\\n".join(l for l in text.splitlines() if l.endswith("{"))
            else:  # its thunk pass did, or nothing did (no dump after the thunk passes)
                dumps = glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))
                shown = open(dumps[0]).read() if dumps else "no thunk sequence after thunk passes"
                inside, outside = custom_call_thunks(shown)
                missing = [] if outside == 0 and inside == len(calls) else targets
        if missing:  # where the calls went
            print(shown)
        assert not missing, f"{name}: not in a command buffer: {missing}"

    def run(name, f, make, targets, tol=2e-5):
        g = jax.jit(f)
        for seed in (0, 1):  # the second call replays the graph on new inputs
            args = make(seed)
            got = g(*jax.device_put(args, gpu))
            want = jax.jit(f)(*jax.device_put(args, cpu))
            jax.tree.map(lambda a, b: close(a, b, tol), got, want)
        check_captured(name, g, jax.device_put(make(0), gpu), targets)
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
    check_captured("vocab-parallel", g, jax.device_put(ce(0), gpu), [
        "xent_vocab_parallel_records", "xent_vocab_parallel_merge",
        "xent_vocab_parallel_backward"])
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

"""xent.jax.linear_cross_entropy against the float64 oracle of the logits it never forms
(hidden @ weight.T + bias): values and the gradients of hidden, weight and bias for every
option and training choice (order, accumulate; the sparse backward within the bound of the
probabilities it skips), jit / vmap / checkpoint (on the CPU, and on a GPU when jax sees one),
the errors for bad arguments, and float64 (on the CPU device; a GPU's handlers refuse it by
name)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_cross_entropy import (
    OPTIONS,
    assert_close,
    expect_float64_refused_on_gpu,
    oracle,
    put,
    resolve,
)

import xent.jax as xj
from xent.jax import _core


def make(rows, dim, classes, dtype=jnp.float32, seed=0, bias=True):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k[0], (*rows, dim), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (classes, dim), jnp.float32) / np.sqrt(dim)).astype(dtype)
    b = jax.random.normal(k[2], (classes,), jnp.float32).astype(dtype) if bias else None
    y = jax.random.randint(k[3], rows, 0, classes)
    return h, w, b, y


def linear_oracle(h, w, b, y, **kw):
    """Loss and the gradients of hidden, weight and bias (float64) of sum(loss)."""
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    logits = h64 @ w64.T + (0.0 if b is None else np.asarray(b, np.float64))
    loss, _, d = oracle(logits, y, **kw)
    d2 = d.reshape(-1, w64.shape[0])
    return (
        np.sum(loss),
        (d2 @ w64).reshape(h64.shape),
        d2.T @ h64.reshape(-1, w64.shape[1]),
        d2.sum(0),
    )


# The training choices beyond the defaults (each exact: the same values within float32's sums).
CHOICES = [{}, {"order": "low_memory"}, {"accumulate": "output"}]


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(kw) or "defaults")
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: ",".join(c.values()) or "default")
def test_matches_float64_oracle(kw, with_bias, choice, device):
    classes = 29
    h, w, b, y = make((3, 5), 16, classes, bias=with_bias)
    h, w, y = put(device, h, w, y)
    b = None if b is None else put(device, b)[0]
    kw = resolve(kw, classes)
    if "weight" in kw:
        kw["class_weight"] = kw.pop("weight")
    oracle_kw = {("weight" if k == "class_weight" else k): v for k, v in kw.items()}
    want, want_dh, want_dw, want_db = linear_oracle(h, w, b, y, **oracle_kw)

    def f(h, w, b):
        return xj.linear_cross_entropy(h, w, y, b, **kw, **choice).sum()

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(h, w, b)
    assert_close(loss, want, 2e-5 * max(1.0, abs(want)))
    assert_close(grads[0], want_dh, 2e-5)
    assert_close(grads[1], want_dw, 2e-5)
    if with_bias:
        assert_close(grads[2], want_db, 2e-5)
    else:
        assert grads[2] is None


def test_matches_cross_entropy_of_the_logits_in_bfloat16(device):
    h, w, b, y = put(device, *make((4, 6), 32, 40, jnp.bfloat16))
    kw = {"label_smoothing": 0.1, "z_loss": 1e-3}
    got = jax.value_and_grad(lambda h: xj.linear_cross_entropy(h, w, y, b, **kw))(h)
    logits = h.astype(jnp.float32) @ w.astype(jnp.float32).T + b.astype(jnp.float32)
    want = jax.value_and_grad(
        lambda h: xj.cross_entropy(
            (h.astype(jnp.float32) @ w.astype(jnp.float32).T + b.astype(jnp.float32)), y, **kw
        )
    )(h)
    assert logits.shape == (4, 6, 40)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
    assert_close(got[0], want[0], 2e-2)
    assert_close(got[1], want[1], 2e-2)


def test_float64_matches_oracle():
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        h, w, b, y = make((7,), 8, 13, jnp.float64)
        for reduction in ("mean", "sum", "none"):
            loss, grads = jax.value_and_grad(
                lambda h, w, b, r=reduction: xj.linear_cross_entropy(
                    h, w, y, b, reduction=r, softcap=3.0
                ).sum(),
                argnums=(0, 1, 2),
            )(h, w, b)
            want = linear_oracle(h, w, b, y, reduction=reduction, softcap=3.0)
            assert_close(loss, want[0], 1e-12)
            for g, wg in zip(grads, want[1:]):
                assert_close(g, wg, 1e-12)


def test_float64_on_a_gpu_names_the_cpu(device):
    def calls(device):
        h, w, b, y = put(device, *make((7,), 8, 13, jnp.float64))
        return (
            lambda: xj.linear_cross_entropy(h, w, y, b, reduction="none"),
            lambda: jax.grad(lambda h: xj.linear_cross_entropy(h, w, y, b))(h),
        )

    expect_float64_refused_on_gpu(device, calls)


def test_jit_vmap_and_checkpoint(device):
    h, w, b, y = put(device, *make((3, 4), 8, 11))

    def f(h, w, y):
        return 2.0 * xj.linear_cross_entropy(h, w, y, b, ignore_index=2)

    grad = jax.grad(f, argnums=(0, 1))
    got = jax.jit(jax.vmap(grad, in_axes=(0, None, 0)))(h, w, y)
    for i in range(3):
        want = grad(h[i], w, y[i])
        assert_close(got[0][i], want[0], 1e-6)
        assert_close(got[1][i], want[1], 1e-6)
    assert_close(jax.jit(jax.grad(jax.checkpoint(f)))(h, w, y), grad(h, w, y)[0], 1e-6)


def test_bad_arguments_name_themselves():
    h, w, b, y = make((4,), 8, 6)
    cases = [
        (TypeError, "hidden", {"hidden": h.astype(jnp.int32)}),
        (TypeError, "weight", {"weight": w.astype(jnp.bfloat16)}),
        (ValueError, "weight", {"weight": w[:, :7]}),
        (ValueError, "labels", {"labels": y[:3]}),
        (TypeError, "bias", {"bias": b.astype(jnp.float16)}),
        (ValueError, "bias", {"bias": b[:5]}),
        (ValueError, "weight", {"class_weight": jnp.ones(5)}),
        (ValueError, "reduction", {"reduction": "avg"}),
    ]
    for error, name, change in cases:
        args = {"hidden": h, "weight": w, "labels": y, "bias": b}
        args.update(
            {k: change.pop(k) for k in ("hidden", "weight", "labels", "bias") if k in change}
        )
        with pytest.raises(error, match=name):
            xj.linear_cross_entropy(
                args["hidden"], args["weight"], args["labels"], args["bias"], **change
            )


# --- the sparse backward (sparse_threshold) and the training choices' errors ---------------------


# Three 64-row tiles and a part, five 256-class blocks and a part (the CPU's and CUDA's tiles).
SPARSE_N, SPARSE_D, SPARSE_V = 150, 48, 1300
TAU = 1.0 / 32


def trained(dtype=jnp.float32, seed=0):
    """Each row's hidden state points at its label's weight row (labels among the first 40
    classes), so its softmax is peaked there and the other blocks' tiles are cold; every seventh
    row ignored."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((SPARSE_V, SPARSE_D)) / np.sqrt(SPARSE_D)
    labels = rng.integers(0, 40, SPARSE_N)
    w_y = weight[labels]
    hidden = 14.0 * w_y / (w_y**2).sum(-1, keepdims=True)
    hidden += 0.05 * rng.standard_normal((SPARSE_N, SPARSE_D))
    labels[::7] = -100
    return jnp.asarray(hidden, dtype), jnp.asarray(weight, dtype), jnp.asarray(labels)


def training(h, w, y, reduction, **kw):
    """Loss and (d_hidden, d_weight) with an upstream gradient of 1 (each row's for none)."""
    loss, vjp = jax.vjp(
        lambda h, w: xj.linear_cross_entropy(h, w, y, reduction=reduction, **kw), h, w
    )
    return (loss, *vjp(jnp.ones_like(loss)))


def skipped_bound(h, w, y, reduction, tau):
    """What dropping every g_n p_nj with p_nj < tau can move d_hidden and d_weight by (float64)."""
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    z = h64 @ w64.T
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    valid = (np.asarray(y) != -100).astype(np.float64)
    g = valid / valid.sum() if reduction == "mean" else valid
    drop = np.where(p < tau, p, 0.0) * g[:, None]
    return drop @ np.abs(w64), drop.T @ np.abs(h64)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("order", ["automatic", "low_memory"])
def test_sparse_threshold_keeps_the_loss_and_bounds_the_gradients(reduction, order, device):
    # float32 on the CPU; bfloat16 on a GPU, whose sparse kernels take 16-bit inputs.
    bf16 = device.platform != "cpu"
    h, w, y = put(device, *trained(jnp.bfloat16 if bf16 else jnp.float32))
    exact = training(h, w, y, reduction, order="low_memory")
    sparse = training(h, w, y, reduction, order=order, sparse_threshold=TAU)
    np.testing.assert_array_equal(np.asarray(sparse[0]), np.asarray(exact[0]))
    moved = False
    for got, want, bound in zip(sparse[1:], exact[1:], skipped_bound(h, w, y, reduction, TAU)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        # float32 sums over other tile sets; in bfloat16 one rounding of each result on top (2^-8
        # of the element) and of the bound's terms.
        slack = 1e-5 * np.abs(want).max()
        if bf16:
            slack = 2.0**-7 * (np.abs(want) + bound) + 1e-3 * np.abs(want).max()
        assert (np.abs(got - want) <= bound + slack).all()
        moved |= not np.array_equal(got, want)
    assert moved, "no gradient moved: no tile was skipped"
    if order == "automatic":  # a threshold runs the low-memory order
        named = training(h, w, y, reduction, order="low_memory", sparse_threshold=TAU)
        for x, z in zip(sparse, named):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(z))


def test_sparse_threshold_zero_is_the_exact_call_bit_for_bit(device):
    h, w, y = put(device, *trained(jnp.bfloat16 if device.platform != "cpu" else jnp.float32))
    a = training(h, w, y, "mean", order="low_memory")
    b = training(h, w, y, "mean", order="low_memory", sparse_threshold=0.0)
    c = training(h, w, y, "mean", order="low_memory", sparse_threshold=np.float32(0.0))
    for x, z, u in zip(a, b, c):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(z))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(u))


def test_bad_training_choices_raise_value_error_naming_them():
    h, w, y = put(jax.devices("cpu")[0], *trained())  # the CPU handlers' own checks below
    call = xj.linear_cross_entropy
    cases = [
        ("order", {"order": "slow"}),
        ("order", {"order": 2}),
        ("accumulate", {"accumulate": "bf16"}),
        ("sparse_threshold", {"sparse_threshold": -0.1}),
        ("sparse_threshold", {"sparse_threshold": 1.5}),
        ("sparse_threshold", {"sparse_threshold": float("nan")}),
        ("sparse_threshold", {"sparse_threshold": "0.1"}),
        ("sparse_threshold", {"sparse_threshold": True}),
        ("sparse_threshold", {"sparse_threshold": None}),
        ("sparse_threshold", {"order": "fast", "sparse_threshold": TAU}),
    ]
    for name, kw in cases:
        with pytest.raises(ValueError, match=name):
            call(h, w, y, **kw)
    # The handlers check the choices they are given too (the public call refuses these first).
    none = (jnp.zeros((0,), h.dtype), jnp.zeros((0,), jnp.float32))  # no bias, no class weights
    for name, choices in (
        ("order", {"order": 5}),
        ("accumulate", {"accumulate": 3}),
        ("sparse_threshold", {"order": 1, "sparse_threshold": TAU}),
    ):
        cfg = _core._Config(-100, 1, 0.0, 0.0, 0.0, **choices)
        with pytest.raises(jax.errors.JaxRuntimeError, match=name):
            _core._linear_fused(h, w, none[0], y, none[1], cfg)
    # What only the backend refuses comes back from the handler, named.
    with pytest.raises(jax.errors.JaxRuntimeError, match="sparse_threshold"):
        jax.grad(lambda h: call(h, w, y, label_smoothing=0.1, softcap=5.0, sparse_threshold=TAU))(h)

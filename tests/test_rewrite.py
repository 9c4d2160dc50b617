"""``sinkax.execution.rewrite``: convolutions in XLA:CPU's canonical layout compute the same."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from sinkax import nets
from sinkax.execution.rewrite import canonical_convs, has_convs

CASES = [  # lhs shape, rhs shape, dimension numbers, conv options
    ((2, 9, 9, 3), (3, 3, 3, 4), ("NHWC", "HWIO", "NHWC"), {}),
    ((2, 3, 9, 9), (4, 3, 3, 3), ("NCHW", "OIHW", "NCHW"), {"window_strides": (2, 1)}),
    ((2, 3, 9, 8), (4, 3, 3, 2), ("NCHW", "OIHW", "NHWC"), {"padding": "SAME"}),
    ((9, 2, 8, 3), (3, 2, 3, 4), ("HNWC", "HWIO", "CHWN"), {"padding": ((1, 2), (0, -1))}),
    (
        (2, 9, 9, 3),
        (3, 3, 3, 4),
        ("NHWC", "HWIO", "NHWC"),
        {"lhs_dilation": (2, 1), "padding": ((1, 0), (2, 1))},
    ),
    ((2, 9, 9, 3), (3, 3, 3, 4), ("NHWC", "IOHW", "NCHW"), {"rhs_dilation": (1, 2)}),
    ((2, 3, 11), (4, 3, 3), ("NCH", "OIH", "NCH"), {"window_strides": (2,)}),
    ((2, 5, 6, 7, 3), (2, 3, 2, 3, 4), ("NDHWC", "DHWIO", "NCDHW"), {}),
]


def _conv(dimension_numbers, options):
    options = {"window_strides": None, "padding": "VALID", **options}
    options["window_strides"] = options["window_strides"] or (1,) * (len(dimension_numbers[0]) - 2)
    return functools.partial(
        lax.conv_general_dilated, dimension_numbers=dimension_numbers, **options
    )


def _operands(lhs_shape, rhs_shape, seed=0):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal(lhs_shape, dtype=np.float32)),
        jnp.asarray(rng.standard_normal(rhs_shape, dtype=np.float32)),
    )


def _convs_in(fn, *args):
    """The dimension numbers of every convolution in ``fn``'s jaxpr, sub-jaxprs included."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is lax.conv_general_dilated_p:
                dn = eqn.params["dimension_numbers"]
                yield tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


CANONICAL_2D = ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))


@pytest.mark.parametrize(("lhs_shape", "rhs_shape", "dimension_numbers", "options"), CASES)
def test_a_convolution_and_its_gradients_compute_the_same(
    lhs_shape, rhs_shape, dimension_numbers, options
):
    conv = _conv(dimension_numbers, options)
    lhs, rhs = _operands(lhs_shape, rhs_shape)

    def loss_and_grads(x, w):
        out, pullback = jax.vjp(conv, x, w)
        return out, pullback(jnp.sin(out))

    rewritten = canonical_convs(loss_and_grads)
    for a, b in zip(
        jax.tree.leaves(jax.jit(rewritten)(lhs, rhs)),
        jax.tree.leaves(jax.jit(loss_and_grads)(lhs, rhs)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    if len(lhs_shape) == 4:
        assert set(_convs_in(rewritten, lhs, rhs)) == {CANONICAL_2D}


def test_grouped_convolutions_are_left_as_they_are():
    conv = _conv(("NHWC", "HWIO", "NHWC"), {"feature_group_count": 2})
    lhs, rhs = _operands((2, 7, 7, 4), (3, 3, 2, 4))
    assert not has_convs(jax.make_jaxpr(conv)(lhs, rhs))
    np.testing.assert_array_equal(canonical_convs(conv)(lhs, rhs), conv(lhs, rhs))


def test_convolutions_inside_scan_and_cond_bodies_are_rewritten():
    conv = _conv(("NCHW", "OIHW", "NCHW"), {"padding": "SAME"})
    lhs, rhs = _operands((2, 3, 6, 6), (3, 3, 3, 3))

    def fn(x, w):
        x = lax.cond(x.sum() > 0, lambda x: conv(x, w), lambda x: -conv(x, w), x)
        return lax.scan(lambda c, _: (jnp.tanh(conv(c, w)), None), x, length=3)[0]

    rewritten = canonical_convs(fn)
    np.testing.assert_allclose(rewritten(lhs, rhs), fn(lhs, rhs), rtol=1e-4, atol=1e-5)
    assert set(_convs_in(rewritten, lhs, rhs)) == {CANONICAL_2D}


def test_lenet5_train_step_matches_the_original():
    params = jax.tree.map(lambda a: 10.0 * a, nets.lenet5_init(jax.random.key(1)))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 32, 32, 1), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, 4).astype(np.int32))

    def grads(p):
        logits = nets.lenet5_apply(p, x)
        return jax.grad(
            lambda q: optax.softmax_cross_entropy_with_integer_labels(
                nets.lenet5_apply(q, x), y
            ).mean()
        )(p), logits

    assert _convs_in(grads, params) != [CANONICAL_2D] * 6  # the weight gradients are not
    assert set(_convs_in(canonical_convs(grads), params)) == {CANONICAL_2D}
    for a, b in zip(
        jax.tree.leaves(jax.jit(canonical_convs(grads))(params)),
        jax.tree.leaves(jax.jit(grads)(params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_function_without_convolutions_is_called_as_it_is():
    calls = []

    def fn(x):
        calls.append(x)
        return x * 2

    assert float(canonical_convs(fn)(jnp.float32(2))) == 4.0
    assert len(calls) == 2  # traced once to look, then called

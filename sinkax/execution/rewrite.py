"""Convolutions rewritten so that XLA:CPU compiles them well inside a loop body.

XLA:CPU runs a convolution on its fast kernels (Eigen) only in the canonical layout: input
NHWC, kernel HWIO, output NHWC. Its ``ConvCanonicalization`` pass transposes every other
convolution into that layout -- but only in the *entry* computation. Inside a ``while`` body (a
``lax.scan``) a convolution in any other layout stays a generic, naive loop nest. Autodiff emits
exactly such convolutions: the weight gradient of an NHWC/HWIO convolution has
``dim_labels=f01b_i01o->01bf``. So a ``lax.conv_general_dilated`` train step (flax
``nn.Conv``) runs several times slower in a scan than as a standalone jitted step.

:func:`canonical_convs` does that pass's job at the jaxpr level, where the loop body is still
visible: each ``conv_general_dilated`` equation of a function's jaxpr (also inside ``pjit``,
``custom_jvp``/``custom_vjp``, ``scan``/``while``/``cond`` sub-jaxprs) becomes transposes into
the canonical layout, the same convolution there, and a transpose back -- the program XLA's own
pass produces for a standalone step. Convolutions with ``feature_group_count`` or
``batch_group_count`` other than 1, and those not 1-D to 3-D, are left as they are.

>>> import jax, jax.numpy as jnp
>>> from jax import lax
>>> def f(x, w):
...     nchw = ("NCHW", "OIHW", "NCHW")
...     return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=nchw)
>>> x, w = jnp.ones((2, 3, 6, 6)), jnp.ones((4, 3, 3, 3))
>>> bool(jnp.allclose(canonical_convs(f)(x, w), f(x, w)))
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
from jax import lax


def canonical_conv(lhs: jax.Array, rhs: jax.Array, **params: Any) -> jax.Array:
    """``lax.conv_general_dilated_p``'s convolution with ``params``, run in the canonical
    layout (input N-spatial-C, kernel spatial-I-O, output N-spatial-O) between transposes."""
    dn = params["dimension_numbers"]
    nd = lhs.ndim - 2
    lhs = lhs.transpose(dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1])
    rhs = rhs.transpose(*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])
    spatial = tuple(range(1, nd + 1))
    canonical = lax.ConvDimensionNumbers(
        lhs_spec=(0, nd + 1, *spatial),
        rhs_spec=(nd + 1, nd, *range(nd)),
        out_spec=(0, nd + 1, *spatial),
    )
    out = lax.conv_general_dilated_p.bind(
        lhs, rhs, **{**params, "dimension_numbers": canonical}
    )  # axes: batch, spatial..., feature -- the out_spec entries 0, 2.., 1
    order = (0, *range(2, nd + 2), 1)
    return out.transpose(np.argsort([dn.out_spec[i] for i in order]))


def _rewritable(params: dict[str, Any], ndim: int) -> bool:
    return (
        params["feature_group_count"] == 1 and params["batch_group_count"] == 1 and 3 <= ndim <= 5
    )


def _is_canonical(dn: Any) -> bool:
    nd = len(dn.lhs_spec) - 2
    spatial = tuple(range(1, nd + 1))
    return (
        tuple(dn.lhs_spec) == (0, nd + 1, *spatial)
        and tuple(dn.rhs_spec) == (nd + 1, nd, *range(nd))
        and tuple(dn.out_spec) == (0, nd + 1, *spatial)
    )


def has_convs(closed: jcore.ClosedJaxpr) -> bool:
    """Whether ``closed`` (or a sub-jaxpr of it) has a convolution :func:`canonical_convs`
    would rewrite."""
    return any(_needs_rewrite(eqn) for eqn in _all_eqns(closed.jaxpr))


def _needs_rewrite(eqn: Any) -> bool:
    return (
        eqn.primitive is lax.conv_general_dilated_p
        and _rewritable(eqn.params, eqn.invars[0].aval.ndim)
        and not _is_canonical(eqn.params["dimension_numbers"])
    )


def _all_eqns(jaxpr: jcore.Jaxpr) -> Any:
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def _rewrite_param(value: Any) -> Any:
    if isinstance(value, jcore.ClosedJaxpr) and has_convs(value):
        return _rewrite_closed(value)
    if isinstance(value, tuple) and any(isinstance(v, jcore.ClosedJaxpr) for v in value):
        return tuple(_rewrite_param(v) for v in value)
    return value


def _rewrite_closed(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    run = functools.partial(_evaluate, closed.jaxpr, closed.consts)
    return jax.make_jaxpr(lambda *args: run(args))(*avals)


def _evaluate(jaxpr: jcore.Jaxpr, consts: Any, args: Any) -> list[Any]:
    """``jaxpr`` evaluated on ``args``, its convolutions rewritten (see :func:`canonical_conv`)."""
    env: dict[Any, Any] = {}

    def read(var: Any) -> Any:
        return var.val if isinstance(var, jcore.Literal) else env[var]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if _needs_rewrite(eqn):
            outs = [canonical_conv(*invals, **eqn.params)]
        else:
            params = {k: _rewrite_param(v) for k, v in eqn.params.items()}
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def canonical_convs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every convolution of its jaxpr in XLA:CPU's canonical layout (see the module
    docstring); same results up to float summation order. Traces ``fn`` at each call (cheap
    under ``jax.jit``, where that happens once per compile); a ``fn`` without such
    convolutions is called as it is."""

    @functools.wraps(fn)
    def rewritten(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not has_convs(closed):
            return fn(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return rewritten

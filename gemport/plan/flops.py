"""The products a traced step computes: FLOPs counted from its program, each loop's body times its trips.

XLA's cost analysis counts a loop's body once, whatever its trips: the scanned decoder (``step.scan``) and the chunked
loss (``step.chunked_loss``) are loops, so for them it reports one block of layers and one chunk of logits (Gemma 4
31B's 60 layers: 12 GFLOPs a token, for about 125). It also counts per device, so work SPMD repeats on several
devices counts on each. `product_flops` counts the program JAX traced instead: every ``dot_general`` (2 x the
product of its operands' distinct dimensions), a ``scan``'s body times its length, a ``shard_map``'s body times
its manual devices, a ``cond``'s costliest branch; the model's work once, with what remat recomputes. What it
cannot count is said, not guessed: a Pallas kernel (splash attention on TPU) and a ``while`` loop's trips.
"""

from __future__ import annotations

import dataclasses
import math

from jax.extend import core as jcore


@dataclasses.dataclass(frozen=True)
class ProductFlops:
    """The FLOPs of a program's products.

    Attributes:
      flops: every counted ``dot_general``'s 2 M N K, times the trips of the loops around it.
      uncounted: what holds products this count leaves out, by kind: ``"Pallas kernels"`` (a ``pallas_call``,
        such as splash attention), ``"while loops"`` (a body counted once; its trips are not in the program).
    """

    flops: int
    uncounted: frozenset[str] = frozenset()

    def __add__(self, other: "ProductFlops") -> "ProductFlops":
        return ProductFlops(self.flops + other.flops, self.uncounted | other.uncounted)

    def __mul__(self, trips: int) -> "ProductFlops":
        return ProductFlops(self.flops * trips, self.uncounted)


def _dot(eqn) -> int:
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    (_, contract), (_, batch) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs) if i not in contract and i not in batch]
    return 2 * math.prod(lhs) * math.prod(rhs_free)


def _jaxprs(value):
    if isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr)):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs(v)


def product_flops(jaxpr: jcore.Jaxpr | jcore.ClosedJaxpr) -> ProductFlops:
    """The FLOPs of ``jaxpr``'s products (``jax.make_jaxpr(f)(...)``, or a traced step's ``.jaxpr``), global shapes:
    the whole mesh's work.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(x, w):  # x [4, 8] through three [8, 8] layers
      ...     return jax.lax.scan(lambda x, w: (x @ w, None), x, w)[0]
      >>> product_flops(jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((3, 8, 8)))).flops  # 3 x 2 x 4 x 8 x 8
      1536
    """
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    total = ProductFlops(0)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += ProductFlops(_dot(eqn))
        elif name == "pallas_call":  # its body is one grid step's, in blocks: not the call's work
            total += ProductFlops(0, frozenset({"Pallas kernels"}))
        elif name == "scan":
            total += product_flops(eqn.params["jaxpr"]) * eqn.params["length"]
        elif name == "cond":
            counts = [product_flops(b) for b in eqn.params["branches"]]
            costliest = max(counts, key=lambda c: c.flops)
            total += ProductFlops(costliest.flops, frozenset().union(*(c.uncounted for c in counts)))
        elif name == "shard_map":
            devices = math.prod(eqn.params["mesh"].shape[a] for a in eqn.params["newly_manual_axes"])
            total += product_flops(eqn.params["jaxpr"]) * devices
        else:
            inner = ProductFlops(0, frozenset({"while loops"}) if name == "while" else frozenset())
            for sub in (j for value in eqn.params.values() for j in _jaxprs(value)):
                inner += product_flops(sub)
            total += inner
    return total


__all__ = ["ProductFlops", "product_flops"]

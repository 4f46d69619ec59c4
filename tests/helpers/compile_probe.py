"""Run as a script: three optimizer steps of a LoRA-shaped jitted step (RMS norm, products, GELU's tanh form, a
soft-cap, log-sum-exp, Adam's moments), printing the factors and the loss as hex bytes, for
tests/test_compile_level.py to compare across XLA flags."""

import sys

import jax
import jax.numpy as jnp
import numpy as np


def loss(w, a, b, x):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    z = jax.nn.gelu(h @ w + (h @ a) @ b * 2.0, approximate=True)
    z = 30.0 * jnp.tanh(z / 30.0)
    return jnp.mean(jax.nn.logsumexp(z, -1) - z[:, 0])


@jax.jit
def step(w, a, b, x, m, v):
    g = jax.grad(loss, argnums=(1, 2))(w, a, b, x)
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
    factors = jax.tree.map(lambda p, m, v: p - 1e-2 * m / (jnp.sqrt(v) + 1e-8), (a, b), m, v)
    return factors, m, v


def main():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (64, 96))
    w, a, b = (jax.random.normal(key, shape) / 10 for key, shape in zip(k[1:], ((96, 128), (96, 8), (8, 128))))
    m = v = (jnp.zeros_like(a), jnp.zeros_like(b))
    for _ in range(3):
        (a, b), m, v = step(w, a, b, x, m, v)
    sys.stdout.write(np.concatenate([np.ravel(np.asarray(t)) for t in (a, b, loss(w, a, b, x))]).tobytes().hex())


if __name__ == "__main__":
    main()

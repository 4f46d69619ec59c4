"""Where a TPU's float32 leaves float32's precision: each elementwise function the Gemma models call, on the chip and
on the host's CPU against float64 (with tanh and exp also computed from products and sums, ``products_tanh`` and
``products_exp``); a miniature Gemma 4 31B's float32 forward (Tunix, ``"highest"`` products, gemport's RoPE) on the
chip against the CPU with the chip's tanh and exp and with each replaced by its from-products form; the same forward
compiled whole on each device, the operations whose error most exceeds their inputs' first; then its logits with
Tunix's RoPE and with gemport's (``step.rope``), and each operation run on the chip on the CPU's inputs, the
operations furthest from the CPU's output first.

On the TPU machine, from the project's root: ``source .whl-tpu/setup.sh && python3 tools/tpu/op_precision.py OUT``
(JSON lines appended to ``OUT/op_precision.jsonl``); docs/tpu.md, "The chip's float32 functions", has the findings.
"""

import collections
import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import source_info_util  # the user frame of each traced operation
from jax.extend import core

from gemport.specs import GemmaSpec
from gemport.step.rope import exact_rope

EXACT = {"reshape", "broadcast_in_dim", "transpose", "convert_element_type", "iota", "squeeze", "slice",
         "concatenate", "select_n", "split", "pad", "gather", "stop_gradient", "and", "lt", "max", "reduce_max",
         "dynamic_slice", "copy", "copy_p", "expand_dims"}
"""Operations whose float32 result is exact on any backend: not run on the chip."""

FUNCTIONS = {  # name: (function, its float64 reference, inputs from standard normal x)
    "tanh": (jnp.tanh, np.tanh, lambda x: x),
    "exp": (jnp.exp, np.exp, lambda x: x),
    "logistic": (jax.nn.sigmoid, lambda x: 1 / (1 + np.exp(-x)), lambda x: x),
    "erf": (jax.scipy.special.erf, np.vectorize(math.erf), lambda x: x),
    "log": (jnp.log, np.log, lambda x: np.abs(x) + 0.1),
    "rsqrt": (jax.lax.rsqrt, lambda x: 1 / np.sqrt(x), lambda x: np.abs(x) + 0.1),
    "sqrt": (jnp.sqrt, np.sqrt, lambda x: np.abs(x) + 0.1),
    "reciprocal": (lambda x: 1 / x, lambda x: 1 / x, lambda x: np.abs(x) + 0.1),
    "sin": (jnp.sin, np.sin, lambda x: 60 * x),
    "cos": (jnp.cos, np.cos, lambda x: 60 * x),
    "power 1e6^-x": (lambda x: jnp.power(1e6, -x), lambda x: 1e6 ** -x, np.abs),
}


LN2_HI, LN2_LO = np.float32(0.693145751953125), np.float32(1.428606765330187e-06)  # LN2_HI: 16 bits, k * LN2_HI exact


def _reduced(y):
    """y = k ln 2 + r, |r| <= ln 2 / 2: (2^k, r) from products and sums, exact for |k| < 2^8."""
    k = jnp.round(y * np.float32(1 / math.log(2)))
    r = (y - k * LN2_HI) - k * LN2_LO
    scale = jax.lax.bitcast_convert_type(((k.astype(jnp.int32) + 127) << 23), jnp.float32)
    return scale, r


def _expm1_reduced(r):
    # Taylor to r^10 / 10!: the next term is 2e-13 of the sum at |r| = ln 2 / 2, so only the float32 roundings remain
    p = jnp.zeros_like(r)
    for n in range(10, 0, -1):
        p = (p + np.float32(1 / math.factorial(n))) * r
    return p


def products_exp(x):
    """exp(x) float32 from products, sums and one exponent shift: within a few ulp of float64 on any device."""
    scale, r = _reduced(jnp.clip(x, -87.0, 88.0))
    return jnp.where(x < -87.0, 0.0, scale * (1 + _expm1_reduced(r))).astype(x.dtype)


def products_tanh(x):
    """tanh(x) float32 as expm1(2|x|) / (expm1(2|x|) + 2), signed: within a few ulp of float64 on any device."""
    scale, r = _reduced(2 * jnp.minimum(jnp.abs(x), 10.0))  # tanh(10) rounds to 1 in float32
    e = scale * _expm1_reduced(r) + (scale - 1)
    return (jnp.sign(x) * (e / (e + 2))).astype(x.dtype)


FUNCTIONS |= {"tanh, from products": (products_tanh, np.tanh, lambda x: x),
              "exp, from products": (products_exp, np.exp, lambda x: x)}
SUBSTITUTES = {"tanh": products_tanh, "exp": products_exp}


def functions(chip, cpu, write):
    x = np.random.default_rng(0).standard_normal(1 << 16)
    for name, (f, reference, domain) in FUNCTIONS.items():
        arg = domain(x).astype(np.float32)
        want = reference(arg.astype(np.float64))  # at the float32 inputs: the function's error only
        for device in (chip, cpu):
            got = np.asarray(jax.jit(f)(jax.device_put(arg, device)), np.float64)
            write(function=name, device=device.platform,
                  max_relative=float(np.max(np.abs(got - want) / np.abs(want))),
                  max_absolute=float(np.max(np.abs(got - want))))


def miniature() -> GemmaSpec:
    full = GemmaSpec.preset("gemma4-31b")
    return dataclasses.replace(full, num_layers=6, layer_types=full.layer_types[:6], hidden=256, mlp=512, vocab=512,
                               head_dim=64, global_head_dim=128, sliding_window=32)


def forward_of(cpu):
    """The miniature's float32 forward (state, tokens) -> logits, its jaxpr at ``"highest"``, its state and 2 x 64
    tokens, on the CPU."""
    spec = miniature()
    with jax.default_device(cpu):
        model = spec.tunix_model_class()(spec.to_tunix(param_dtype=jnp.float32), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, spec.vocab, (2, 64)), jnp.int32)
    b, t = tokens.shape

    def forward(state, tokens):
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        return nnx.merge(graphdef, state)(tokens, positions, None, jnp.tril(jnp.ones((b, t, t), bool)))[0]

    with jax.default_matmul_precision("highest"), exact_rope():  # the rotation gemport runs (step.rope)
        return forward, jax.make_jaxpr(forward)(state, tokens), state, tokens


def _bound(e, ins) -> list:
    """Equation ``e``'s outputs on ``ins``, as a list."""
    outs = e.primitive.bind(*ins, **e.params)
    return outs if e.primitive.multiple_results else [outs]


def _walk(jaxpr, consts, args, leaf) -> list:
    """``jaxpr``'s outputs on ``args``, descending into the jaxprs of calls (jit, custom_jvp); ``leaf(e, ins)`` gives
    each other equation's outputs."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        outs = _walk(inner.jaxpr, inner.consts, ins, leaf) if hasattr(inner, "consts") else leaf(e, ins)
        env.update(zip(e.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _where(e) -> str:
    frame = source_info_util.user_frame(e.source_info.traceback)
    return f"{Path(frame.file_name).name}:{frame.start_line} {frame.function_name}" if frame else ""


def _relative(want, got) -> float:
    # max |got - want| over max |want|, where want is finite (masks hold -inf)
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    finite = np.isfinite(want)
    scale = np.abs(want[finite]).max() if finite.any() else 0.0
    return float(np.abs(got - want)[finite].max() / scale) if scale else 0.0


def operations(chip, cpu, write, top: int = 25):
    forward, closed, state, tokens = forward_of(cpu)
    with jax.default_matmul_precision("highest"):  # a new function: jit would reuse forward_of's trace (its RoPE)
        on_cpu, on_chip = (np.asarray(jax.jit(lambda s, t: forward(s, t), device=d)(state, tokens), np.float64)
                           for d in (cpu, chip))
    write(what="logits", chip_from_cpu=float(np.abs(on_chip - on_cpu).max()), max_logit=float(np.abs(on_cpu).max()))
    with jax.default_matmul_precision("highest"), exact_rope():  # the inverse frequencies the host computes (step.rope)
        exact = [np.asarray(jax.jit(lambda s, t: forward(s, t), device=d)(state, tokens), np.float64)
                 for d in (cpu, chip)]
    write(what="logits, exact_rope", chip_from_cpu=float(np.abs(exact[1] - exact[0]).max()),
          max_logit=float(np.abs(exact[0]).max()))
    # The CPU runs the forward op by op, keeping each inexact operation's inputs and output; the chip then runs all
    # of those operations in one compiled program, each on the CPU's inputs (a compile per operation took longer
    # than the session's chip time), so each one's error is its own, not what it inherited.
    taken = []

    def keep(e, ins):  # run on the CPU, kept with its inputs
        outs = _bound(e, [jax.device_put(i, cpu) for i in ins])
        if e.primitive.name not in EXACT and any(jnp.issubdtype(o.dtype, jnp.floating) for o in outs):
            taken.append((e, [np.asarray(i) for i in ins], [np.asarray(o) for o in outs]))
        return outs

    with jax.default_matmul_precision("highest"):
        _walk(closed.jaxpr, closed.consts, jax.tree.leaves(state) + [tokens], keep)

        def each(inputs):
            outs = [e.primitive.bind(*ins, **e.params) for (e, _, _), ins in zip(taken, inputs)]
            return [o if e.primitive.multiple_results else [o] for (e, _, _), o in zip(taken, outs)]

        on_chip = jax.jit(each, device=chip)([ins for _, ins, _ in taken])
    found = []
    for (e, _, outs), chip_outs in zip(taken, on_chip):
        for o, c in zip(outs, chip_outs):
            if not (jnp.issubdtype(o.dtype, jnp.floating) and o.size):
                continue
            found.append((_relative(o, c), e.primitive.name, str(e.params.get("precision", "")), _where(e)))
    found.sort(reverse=True)
    for worst, primitive, precision, where in found[:top]:
        write(operation=primitive, relative=worst, precision=precision, where=where)
    by_primitive = collections.defaultdict(float)
    for worst, primitive, _, _ in found:
        by_primitive[primitive] = max(by_primitive[primitive], worst)
    write(worst_by_operation=dict(sorted(by_primitive.items(), key=lambda kv: -kv[1])))


def program(chip, cpu, write, top: int = 25):
    """The miniature's forward compiled whole on each device, every operation's output returned: the operations
    whose output leaves the CPU's far more than their inputs had (what fusion changes, which one operation run alone
    on the chip does not show: the forward's logits move 6.4e-4 on a v5e, its worst operation alone 5.6e-5)."""
    _, closed, state, tokens = forward_of(cpu)
    records = []  # per operation: (primitive, where, its inputs' and outputs' indices into the returned values)

    def every(args):
        records.clear()
        values = []

        def run(jaxpr, consts, args, slots):
            env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
            slot = dict(zip(jaxpr.invars, slots))

            def read(v):
                return v.val if isinstance(v, core.Literal) else env[v]

            for e in jaxpr.eqns:
                ins = [read(v) for v in e.invars]
                in_slots = [None if isinstance(v, core.Literal) else slot.get(v) for v in e.invars]
                inner = e.params.get("jaxpr")
                if inner is not None and hasattr(inner, "consts"):
                    outs, out_slots = run(inner.jaxpr, inner.consts, ins, in_slots)
                else:
                    outs = e.primitive.bind(*ins, **e.params)
                    outs = outs if e.primitive.multiple_results else [outs]
                    out_slots = []
                    for o in outs:
                        if jnp.issubdtype(o.dtype, jnp.floating) and e.primitive.name not in EXACT:
                            values.append(o)
                            out_slots.append(len(values) - 1)
                        else:  # exact: carries its input's error
                            out_slots.append(next((s for s in in_slots if s is not None), None))
                    if e.primitive.name not in EXACT:
                        records.append((e.primitive.name, _where(e), in_slots, out_slots))
                env.update(zip(e.outvars, outs))
                slot.update(zip(e.outvars, out_slots))
            return [read(v) for v in jaxpr.outvars], [slot.get(v) for v in jaxpr.outvars]

        run(closed.jaxpr, closed.consts, args, [None] * len(args))
        return values

    leaves = jax.tree.leaves(state) + [tokens]
    with jax.default_matmul_precision("highest"):
        on_cpu = [np.asarray(v, np.float64) for v in jax.jit(every, device=cpu)(leaves)]
        on_chip = [np.asarray(v, np.float64) for v in jax.jit(every, device=chip)(leaves)]

    def error(i):
        return 0.0 if i is None else _relative(on_cpu[i], on_chip[i])

    jumps = []
    for primitive, where, in_slots, out_slots in records:
        inherited = max([error(i) for i in in_slots] + [0.0])
        for i in out_slots:
            if i is not None:
                got = error(i)
                jumps.append((got / max(inherited, 2.0**-24), got, inherited, primitive, where))
    jumps.sort(reverse=True)
    for jump, got, inherited, primitive, where in jumps[:top]:
        write(program_operation=primitive, relative=got, inputs_relative=inherited, jump=jump, where=where)


def _evaluated(closed, substitutes):
    """``closed``'s function with each primitive named in ``substitutes`` computed by its substitute."""
    def leaf(e, ins):
        return [substitutes[e.primitive.name](*ins)] if e.primitive.name in substitutes else _bound(e, ins)

    return lambda *args: _walk(closed.jaxpr, closed.consts, jax.tree.leaves(args), leaf)


def substituted(chip, cpu, write):
    """The miniature's logits (RoPE's fix in) on the chip against the CPU's, with the chip's own tanh and exp and
    with each replaced by its from-products form: how much of the float32 gap those two functions are."""
    _, closed, state, tokens = forward_of(cpu)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(_evaluated(closed, {}), device=cpu)(state, tokens)[0], np.float64)
        for names in ((), ("tanh",), ("exp",), ("tanh", "exp")):
            substitutes = {n: SUBSTITUTES[n] for n in names}
            for device in (chip, cpu):
                got = np.asarray(jax.jit(_evaluated(closed, substitutes), device=device)(state, tokens)[0], np.float64)
                write(what="logits, exact_rope", substituted=list(names), device=device.platform,
                      from_cpu=float(np.abs(got - want).max()), max_logit=float(np.abs(want).max()))


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    chip, cpu = jax.devices()[0], jax.devices("cpu")[0]

    def write(**line):
        line = {**line, "device_kind": chip.device_kind, "jax": jax.__version__}
        print(json.dumps(line), flush=True)
        with (out / "op_precision.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    functions(chip, cpu, write)
    substituted(chip, cpu, write)
    program(chip, cpu, write)
    operations(chip, cpu, write)


if __name__ == "__main__":
    main()

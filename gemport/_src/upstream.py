"""Every touch of Tunix's, Qwix's and JAX's internals, in one place; Tunix's and Qwix's checked against the versions
they were written for (JAX's are one error text, `tracer_errors_without_origin`, and the persistent cache's compile,
`refusals_kept`).

Qwix 0.1.x keeps its einsum interception, LoRA parameter creation, 4-bit arrays and NF4 buckets private
(``qwix._src``); Tunix 0.1.7's ``PeftTrainer`` keeps its mode, metric buffers, progress bar and the hooks it calls
around a step private, and its models shard activations through a module function. gemport reaches them only
through this module, so an upgrade of either is a change here (and of the versions below), nowhere else; a test
(``tests/test_imports.py``) fails when another module touches them. Importing this module checks the installed
versions; Tunix is imported only by what needs it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import time
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from flax import nnx

from gemport._src.extras import require
from gemport.errors import MissingDependencyError

TUNIX_VERSION = "0.1.7"
"""The google-tunix release gemport's trainer hooks, sharding patch and MoE routing were written against."""

QWIX_VERSION = "0.1"
"""The qwix release series (``qwix>=0.1.8,<0.2``) whose private providers and arrays gemport uses."""


def _check(distribution: str, wanted: str, extra: str) -> None:
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return  # `gemport._src.extras.require` names the extra where a feature needs it
    if found != wanted and not found.startswith(wanted + "."):
        raise MissingDependencyError(
            f"gemport reaches into {distribution} {wanted}'s internals (gemport._src.upstream), but {distribution} "
            f"{found} is installed; install {distribution}=={wanted}{'' if wanted.count('.') > 1 else '.*'} "
            f"(pip install 'gemport[{extra}]')"
        )


_check("qwix", QWIX_VERSION, "tunix")
_check("google-tunix", TUNIX_VERSION, "tunix")


# Qwix ---------------------------------------------------------------------------------------------------------

def _qwix():
    from qwix._src.core import numerics, qarray  # Qwix's privates: checked against its version first
    from qwix._src.providers import lora, ptq  # Qwix's privates: checked against its version first
    from qwix._src.utils import flax_util  # Qwix's privates: checked against its version first

    return lora, ptq, flax_util, qarray, numerics


def nf4_buckets():
    """Qwix's NF4 code values, float [16]."""
    return _qwix()[4].get_nf4_buckets()


def how_to_quantize(**kwargs):
    """Qwix's ``HowToQuantize`` (``qtype``, ``channelwise_axes``, ``tiled_axes``, ...: keywords as there)."""
    return _qwix()[3].HowToQuantize(**kwargs)


def quantize_array(value, how):
    """Qwix's quantization of ``value`` as ``how`` says: a ``qwix.QArray``."""
    return _qwix()[3].quantize(value, how)


def with_aux(array, how):
    """A 4-bit weight as Qwix's PTQ provider keeps it in a param: ``array`` (a ``qwix.QArray``) and ``how``."""
    return _qwix()[1].WithAux(array, how)


def is_with_aux(value) -> bool:
    """Whether ``value`` is a weight of `with_aux`."""
    return isinstance(value, _qwix()[1].WithAux)


def current_module():
    """The nnx module whose call Qwix is intercepting."""
    return _qwix()[2].get_current_module()


def graph_without_module_paths(graphdef: nnx.GraphDef) -> tuple:
    """``graphdef``'s nodes and attributes, but for the path Qwix records on each module (``qwix_path``): two
    layers alike but for their place in the model compare equal."""
    return graphdef.nodes, tuple((name, value) for name, value in graphdef.attributes if name != "qwix_path")


def take_module_path(module: nnx.Module, source: nnx.Module) -> None:
    """Give ``module`` the path Qwix matches its rules against (``qwix_path``, set on each module by
    ``apply_lora_to_model``) of ``source``: Qwix takes the innermost nnx module on the Python stack as the
    current one, and a module of gemport's own (``step.scan.ScannedLayers``) is on it when JAX traces a layer's
    deferred parts (a ``custom_vjp``'s forward) from within it."""
    module.qwix_path = getattr(source, "qwix_path", ())


def find_weight(value):
    """The name of the current module's param holding ``value`` (a weight, 4-bit or not), or None."""
    lora, ptq, flax_util, _, _ = _qwix()
    return flax_util.find_param(value, ptq.WithAux)


def make_rng(stream: str):
    """A key from the current module's Qwix rngs ``stream``."""
    return _qwix()[2].make_rng(stream)


def lora_params(name: str, einsum: str, **kwargs):
    """Qwix's ``(lora_a, lora_b)`` params of the current module's weight ``name``, created on first use (its
    ``_get_or_create_lora_params``; keywords as there), recording ``einsum`` (``"x,a,b->out"``) as the einsum
    Qwix's LoRA merge applies them with."""
    current_module().__setattr__(name + "_lora_einsum_str", einsum)
    return _qwix()[0]._get_or_create_lora_params(name=name, **kwargs)


def lora_dot_general_params(name: str, rhs, dimension_numbers, rule):
    """Qwix's ``(lora_a, lora_b)`` params of the current module's weight ``name`` as its LoRA ``dot_general`` makes
    them (``_create_lora_layer_shapes``, ``_get_or_create_lora_params``), and the shapes ``lora_delta`` takes:
    ``(lora_a, lora_b, (contract_shape, batch_shape, remain_shape))``."""
    lora = _qwix()[0]
    (_, rhs_ca), (_, rhs_ba) = dimension_numbers
    rhs_ra = tuple(i for i in range(rhs.ndim) if i not in rhs_ca and i not in rhs_ba)
    shapes = tuple(tuple(rhs.shape[i] for i in axes) for axes in (rhs_ca, rhs_ba, rhs_ra))
    a_shape, a_transpose, b_shape, b_transpose = lora._create_lora_layer_shapes(rhs_ca, rhs_ba, rhs_ra, *shapes,
                                                                               rule.rank)
    lora_a, lora_b = lora._get_or_create_lora_params(name=name, rule=rule, a_shape=a_shape, b_shape=b_shape,
                                                     a_sharding_transpose=a_transpose,
                                                     b_sharding_transpose=b_transpose)
    return lora_a, lora_b, shapes


def lora_delta(lhs, lora_a, lora_b, dimension_numbers, shapes, rank, precision=None):
    """Qwix's LoRA delta of a ``dot_general`` (``_compute_lora_delta``), unscaled."""
    (lhs_ca, _), (lhs_ba, _) = dimension_numbers
    return _qwix()[0]._compute_lora_delta(lhs, lora_a, lora_b, lhs_ca, lhs_ba, *shapes, rank, precision=precision)


def ptq_dot_general(provider, lhs, rhs, *args, **kwargs):
    """Qwix's PTQ dot_general (the frozen, possibly 4-bit, projection) without the LoRA delta."""
    return _qwix()[1].PtqProvider.dot_general(provider, lhs, rhs, *args, **kwargs)


def ptq_einsum(provider, einsum_str, *operands, **kwargs):
    """Qwix's PTQ einsum (the frozen, possibly 4-bit, projection) without the LoRA delta."""
    return _qwix()[1].PtqProvider.einsum(provider, einsum_str, *operands, **kwargs)


@functools.cache
def lora_provider_class():
    """``qwix.LoraProvider`` whose rule lookup goes through a public ``rule_for(rule)``, so a subclass can change
    the rule a call runs under (Qwix 0.1's ``_get_current_rule_and_op_id``), and ``current_rule(op_name)``."""
    import qwix  # after the version check above

    class LoraProvider(qwix.LoraProvider):
        def rule_for(self, rule):
            return rule

        def _get_current_rule_and_op_id(self, op_name, **kwargs):
            rule, op_id = super()._get_current_rule_and_op_id(op_name, **kwargs)
            return self.rule_for(rule), op_id

        def current_rule(self, op_name):
            return self._get_current_rule_and_op_id(op_name, only_rule=True)[0]

    return LoraProvider


# Tunix --------------------------------------------------------------------------------------------------------

@functools.cache
def peft_trainer_class():
    """``tunix.sft.peft_trainer.PeftTrainer`` whose private hooks call public ones a subclass overrides:

    ``prepare_inputs(inputs, training)`` (each micro-batch before its step; ``training`` False in evaluation),
    ``check_step(buffer)`` (each optimizer step's metrics buffer, before they are written and checkpointed),
    ``after_step(step)`` (after they are written), ``post_train_step(buffer, aux)`` / ``post_eval_step(buffer,
    aux)`` (a step's auxiliary outputs, with the buffer of metrics they go to), ``close_progress_bar()``,
    ``jitted_train_step()`` (the jitted ``step(model, optimizer, inputs)`` that ``train()`` runs; Tunix's own
    donates the optimizer only), ``first_train_step(bind)`` (the ``step(inputs)`` ``train()`` calls, given
    ``bind()``, which binds ``jitted_train_step()`` to the model and optimizer as they are when called),
    ``evaluate()`` (an evaluation of the eval dataset ``train()`` was given, now, as Tunix runs one every
    ``eval_every_n_steps``).
    """

    peft_trainer = require("tunix.sft.peft_trainer", "gemport.run.trainer")

    class PeftTrainer(peft_trainer.PeftTrainer):
        def prepare_inputs(self, inputs, training: bool):
            return inputs

        def check_step(self, buffer) -> None:
            pass

        def after_step(self, step: int) -> None:
            pass

        def post_train_step(self, buffer, aux) -> None:
            pass

        def post_eval_step(self, buffer, aux) -> None:
            pass

        def jitted_train_step(self):

            return nnx.jit(self.create_train_step_fn(), donate_argnames=("optimizer",))

        def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False):
            # Tunix builds its train step inline; the one train() runs is jitted_train_step(), bound to the
            # trainer's model and optimizer as Tunix binds its own.

            fresh = self._jitted_train_step_fn is None
            train_step, eval_step = super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
            if fresh and not skip_jit:

                def bind():  # of the model as it is now: a remat set since is traced by a new binding
                    step = self.jitted_train_step()
                    if cache_nnx_graph:
                        return nnx.cached_partial(step, self.model, self.optimizer)
                    return functools.partial(step, self.model, self.optimizer)

                # Tunix reads train_step.func.jitted_fn (its compile cache's size): a partial of the step
                self._jitted_train_step_fn = train_step = functools.partial(self.first_train_step(bind))
            return train_step, eval_step

        def first_train_step(self, bind):
            return bind()

        def train(self, train_ds, eval_ds=None, *args, **kwargs):
            self.eval_ds = eval_ds
            return super().train(train_ds, eval_ds, *args, **kwargs)

        def evaluate(self) -> None:
            if getattr(self, "eval_ds", None):
                self._run_eval(self.eval_ds, self.jit_train_and_eval_step()[1])

        def close_progress_bar(self) -> None:
            """Closes Tunix's own progress bar (loss and perplexity only), for one that replaces it."""
            if self._pbar is not None:
                self._pbar.close()
                self._pbar = None

        def _prepare_inputs(self, input_data):
            return self.prepare_inputs(input_data, self._mode == "train")

        def _write_train_metrics(self):
            # Tunix calls it once per optimizer step, after it and before its periodic checkpoint.
            if self._buffered_train_metrics is not None:
                self.check_step(self._buffered_train_metrics)
            super()._write_train_metrics()
            self.after_step(self.train_steps)

        def _post_process_train_step(self, aux):
            self.post_train_step(self._buffered_train_metrics, aux)

        def _post_process_eval_step(self, aux):
            self.post_eval_step(self._buffered_eval_metrics, aux)

    return PeftTrainer


def query_norm(attention):
    """A Tunix Gemma attention module's query RMSNorm (its ``_query_norm``), applied to [B, T, N, H]."""
    return attention._query_norm


def key_norm(attention):
    """A Tunix Gemma attention module's key RMSNorm (its ``_key_norm``), applied to [B, S, K, H]."""
    return attention._key_norm


def expert_dispatch(x, choices, weights):
    """Tunix's ``MoERagged`` dispatch: the tokens of ``x`` [B, T, D] sorted by their expert ``choices`` int32
    [B, T, k] (routing ``weights`` [B, T, E]). Returns (tokens per expert [E], sorted tokens [B*T*k, D], the
    reverse permutation, the combination weights [B, T, k]) as ``expert_collect`` takes them."""
    from tunix.models.gemma4 import moe  # Tunix, an extra, on first use

    return moe._expert_dispatch(x, choices, weights)


def expert_collect(out, *, xs_reverse_argsort, xs_combine_weights):
    """Tunix's ``MoERagged`` collection: the experts' outputs ``out`` [B*T*k, D], in ``expert_dispatch``'s order,
    back to [B, T, k, D]."""
    from tunix.models.gemma4 import moe  # Tunix, an extra, on first use

    return moe._expert_collect(out, xs_reverse_argsort=xs_reverse_argsort, xs_combine_weights=xs_combine_weights)


# JAX ---------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def tracer_errors_without_origin():
    """While open, the text of an error about a traced value omits the operations it came from.

    ``getattr(tracer, "sharding", None)``, which Qwix asks of each base weight it adapts and flax of each variable
    it sets, raises an AttributeError that getattr swallows, and JAX writes that error's text first: finding the
    value's origin walks every equation traced so far. Under ``nnx.eval_shape`` (an abstract model, as the plan and
    the dry run build it) that made LoRA's application quadratic in depth: Gemma 4 31B's 60 layers took minutes.
    The text is thrown away unread, so nothing a user sees changes but errors raised inside, which lose that one
    paragraph."""
    from jax._src.interpreters import partial_eval  # JAX's private tracer; only its error text is replaced

    saved = partial_eval.DynamicJaxprTracer._origin_msg
    partial_eval.DynamicJaxprTracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        partial_eval.DynamicJaxprTracer._origin_msg = saved


def _kept_refusal(recorded: bytes | None) -> tuple[str, float] | None:
    """A kept refusal's (error text, seconds its compile took); None where none is kept."""
    # A record cut short (its writer killed: JAX's cache writes in place) is no record: the program compiles.
    try:
        refusal = json.loads(recorded)
        return str(refusal["error"]), float(refusal["seconds"])
    except (ValueError, TypeError, KeyError):
        return None


@contextlib.contextmanager
def refusals_kept(refused: Callable[[BaseException], bool], recalled: Callable[[float], None]):
    """While open, a program JAX's persistent compilation cache misses and XLA refuses (``refused(error)``, e.g.
    libtpu's RESOURCE_EXHAUSTED past the chips' HBM) is kept in that cache under the program's key, and a later
    compile of the same program, in this process or another, raises the kept refusal at once, its first line
    saying so, and calls ``recalled(seconds)`` with what the refused compile took.

    JAX caches executables only, so a refusal was compiled again by every run: under ``gradient_checkpointing:
    true`` on a TPU, a rerun whose first remat was refused paid that compile before loading the one that fits. The
    key is JAX's own (the program, devices, compile options, XLA flags and versions), so what is recalled is what
    the compiler would say again. Only process 0 writes, as JAX does for executables."""
    from jax._src import compilation_cache, compiler  # JAX's private compile path: where a cache key meets XLA

    compile_and_write = compiler._compile_and_write_cache

    def kept(backend, computation, executable_devices, compile_options, host_callbacks, module_name, cache_key):
        cache, key = compilation_cache._get_cache(backend), f"{cache_key}-refused"
        refusal = _kept_refusal(cache.get(key)) if cache is not None else None
        if refusal is not None:
            error, seconds = refusal
            recalled(seconds)
            first, _, rest = error.partition("\n")
            raise jax.errors.JaxRuntimeError(
                f"{first} (recalled: the compile cache kept this program's refusal by an earlier compile)\n{rest}")
        start = time.monotonic()
        try:
            return compile_and_write(backend, computation, executable_devices, compile_options, host_callbacks,
                                     module_name, cache_key)
        except Exception as e:
            if refused(e) and cache is not None and jax.process_index() == 0:
                cache.put(key, json.dumps({"error": str(e), "seconds": time.monotonic() - start}).encode())
            raise

    compiler._compile_and_write_cache = kept
    try:
        yield
    finally:
        compiler._compile_and_write_cache = compile_and_write


@contextlib.contextmanager
def tunix_shard_on(mesh):
    """While open, Tunix's models constrain activations (``tunix.utils.sharding_utils.shard`` and Gemma 4's
    ``shard``) on ``mesh`` whatever the process's own devices are: Tunix 0.1.7 constrains only when they are
    accelerators, so a step traced on a CPU host for a TPU slice's compile-only devices would lack the
    constraints the slice's run has. A mesh of the host's own devices keeps Tunix's behaviour."""
    if mesh.devices.flat[0].platform == jax.devices()[0].platform:
        yield
        return
    from tunix.models.gemma4 import model as gemma4  # Tunix, an extra, on first use
    from tunix.utils import sharding_utils  # Tunix, an extra, on first use

    def shard(x, spec, eager=False):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

    saved = sharding_utils.shard, gemma4.shard
    sharding_utils.shard = gemma4.shard = shard
    try:
        yield
    finally:
        sharding_utils.shard, gemma4.shard = saved


@contextlib.contextmanager
def tunix_rope(*, gemma3, gemma4):
    """While open, Tunix's Gemma 3 and Gemma 4 models call ``gemma3`` and ``gemma4`` (each with the arguments of
    that model module's ``apply_rope``) where they call ``apply_rope``; on close, whatever was there before."""
    from tunix.models.gemma3 import model as g3  # Tunix, an extra, on first use
    from tunix.models.gemma4 import model as g4  # Tunix, an extra, on first use

    saved = g3.apply_rope, g4.apply_rope
    g3.apply_rope, g4.apply_rope = gemma3, gemma4
    try:
        yield
    finally:
        g3.apply_rope, g4.apply_rope = saved


__all__ = [
    "QWIX_VERSION",
    "TUNIX_VERSION",
    "current_module",
    "expert_collect",
    "expert_dispatch",
    "find_weight",
    "how_to_quantize",
    "is_with_aux",
    "key_norm",
    "lora_params",
    "lora_provider_class",
    "make_rng",
    "nf4_buckets",
    "peft_trainer_class",
    "ptq_einsum",
    "quantize_array",
    "query_norm",
    "refusals_kept",
    "tracer_errors_without_origin",
    "tunix_rope",
    "tunix_shard_on",
    "with_aux",
]

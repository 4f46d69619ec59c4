"""Packing-aware attention for Tunix Gemma 3 / Gemma 4 training, computed from ``segment_ids`` without [T, S] scores.

Tunix's attention builds [B, T, N, S] scores and masks them with a dense [B, T, S] ``attention_mask``; its one
fast path (``use_flash_attention``) ignores segments, so packed examples would see each other. Here query t
sees key s when both carry the same segment id and s <= t (and t - s < window on sliding layers): the mask of
``data.attention_mask`` with Tunix's sliding band, so padding (segment 0) sees earlier padding as it does there.

``segment_attention`` is a blockwise (flash-style, online softmax) attention in pure JAX with its own backward
pass, holding one [block, block] tile of scores per head at a time; on TPU the same mask runs on splash
attention (``jax.experimental.pallas.ops.tpu.splash_attention`` with ``SegmentIds``, a ``LocalMask`` on
sliding layers), on GPU's global layers on JAX's Pallas flash attention (``pallas.ops.gpu.attention`` with
segment ids, causal), each inside ``shard_map`` under a mesh (``attend``). ``segment_attention_model`` returns a copy of a Tunix model whose attention layers compute it;
the copy takes ``segment_ids`` [B, T] where Tunix takes ``attention_mask``.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from gemport._src import upstream
from gemport.errors import BatchError, SpecError
from gemport.mesh.dims import FSDP, TP
from gemport.mesh.tpu import platform
from gemport.step.precision import backward_at, traced

BLOCK = 512
"""Query and key tile length of the blockwise attention (rows are padded up to a multiple of it)."""


def _tile_mask(seg_q, seg_k, q_idx, k_idx, window):
    # [B, bq, bk]: same segment, causal, inside the sliding band (Tunix's |t - s| < window).
    mask = (seg_q[:, :, None] == seg_k[:, None, :]) & (k_idx[None, :] <= q_idx[:, None])[None]
    if window is not None:
        mask &= (q_idx[:, None] - k_idx[None, :] < window)[None]
    return mask[:, None, None]  # [B, 1, 1, bq, bk], broadcast over K and G


def _blocks(t, block):
    block = min(block, t)
    return block, -(-t // block)


def _kv_span(num_blocks, block, window):
    # Key blocks a query block can see: all earlier ones, or the few the sliding band reaches.
    if window is None:
        return num_blocks
    return min(num_blocks, -(-(window - 1) // block) + 1)


def _split(x, num_blocks, block):
    # [B, nb * b, ...] -> [nb, B, b, ...]
    return jnp.moveaxis(x.reshape(x.shape[0], num_blocks, block, *x.shape[2:]), 1, 0)


def _merge(x):
    # [nb, B, b, ...] -> [B, nb * b, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _prepare(q, k, v, segment_ids, block):
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    block, num_blocks = _blocks(t, block)
    pad = num_blocks * block - t
    # Padded positions get their own segment (-1): real queries never see them, and they see themselves.
    seg = jnp.pad(jnp.asarray(segment_ids, jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, t + pad, kv_heads, n // kv_heads, h)
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return (_split(q, num_blocks, block), _split(k, num_blocks, block), _split(v, num_blocks, block),
            _split(seg, num_blocks, block), block, num_blocks)


def _forward(q, k, v, segment_ids, window, block):
    qb, kb, vb, sb, block, num_blocks = _prepare(q, k, v, segment_ids, block)
    span = _kv_span(num_blocks, block, window)
    f32 = jnp.float32

    def query_block(i):
        q_i, seg_q = qb[i], sb[i]
        q_idx = i * block + jnp.arange(block)
        bsz, _, kv_heads, groups, h = q_i.shape

        def key_block(carry, jj):
            m, l, acc = carry
            j = i - (span - 1) + jj
            jc = jnp.maximum(j, 0)
            k_j, v_j, seg_k = kb[jc], vb[jc], sb[jc]
            k_idx = jc * block + jnp.arange(block)
            mask = _tile_mask(seg_q, seg_k, q_idx, k_idx, window) & (j >= 0)
            s = jnp.einsum("bqkgh,bskh->bkgqs", q_i, k_j, preferred_element_type=f32)
            m_new = jnp.maximum(m, jnp.where(mask, s, -jnp.inf).max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + jnp.einsum("bkgqs,bskh->bkgqh", p, v_j.astype(f32))
            return (m_new, l, acc), None

        init = (jnp.full((bsz, kv_heads, groups, block), -jnp.inf, f32), jnp.zeros((bsz, kv_heads, groups, block), f32),
                jnp.zeros((bsz, kv_heads, groups, block, h), f32))
        (m, l, acc), _ = jax.lax.scan(key_block, init, jnp.arange(span))
        # Every query sees at least itself, so l > 0.
        return acc / l[..., None], m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(num_blocks))  # [nb, B, K, G, b, H], [nb, B, K, G, b]
    return out, lse


def _output(out, q):
    # [nb, B, K, G, b, H] -> [B, T, N, H] in the queries' dtype.
    nb, bsz, kv_heads, groups, block, h = out.shape
    out = jnp.moveaxis(out, 4, 2).reshape(nb, bsz, block, kv_heads * groups, h)
    return _merge(out)[:, : q.shape[1]].astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, segment_ids, window, block, precision):
    return _output(_forward(q, k, v, segment_ids, window, block)[0], q)


def _attention_fwd(q, k, v, segment_ids, window, block, precision):
    out, lse = _forward(q, k, v, segment_ids, window, block)
    return _output(out, q), (q, k, v, segment_ids, out, lse)


def _attention_bwd(window, block, precision, residuals, d_out):
    with backward_at(precision):
        return _attention_grads(window, block, residuals, d_out)


def _attention_grads(window, block, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    qb, kb, vb, sb, block, num_blocks = _prepare(q, k, v, segment_ids, block)
    span = _kv_span(num_blocks, block, window)
    f32 = jnp.float32
    bsz, t, n, h = q.shape
    kv_heads = k.shape[2]
    groups = n // kv_heads
    pad = num_blocks * block - t
    do = jnp.pad(d_out.astype(f32), ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(bsz, t + pad, kv_heads, groups, h)
    do = jnp.moveaxis(_split(do, num_blocks, block), 2, 4)  # [nb, B, K, G, b, H], as out
    delta = (do * out).sum(-1)  # [nb, B, K, G, b]

    def query_block(carry, i):
        dk, dv = carry
        q_i, seg_q, do_i, lse_i, delta_i = qb[i].astype(f32), sb[i], do[i], lse[i], delta[i]
        q_idx = i * block + jnp.arange(block)

        def key_block(inner, jj):
            dq_i, dk, dv = inner
            j = i - (span - 1) + jj
            jc = jnp.maximum(j, 0)
            k_j, v_j, seg_k = kb[jc].astype(f32), vb[jc].astype(f32), sb[jc]
            k_idx = jc * block + jnp.arange(block)
            mask = _tile_mask(seg_q, seg_k, q_idx, k_idx, window) & (j >= 0)
            s = jnp.einsum("bqkgh,bskh->bkgqs", q_i, k_j)
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            dp = jnp.einsum("bkgqh,bskh->bkgqs", do_i, v_j)
            ds = p * (dp - delta_i[..., None])
            dq_i = dq_i + jnp.einsum("bkgqs,bskh->bqkgh", ds, k_j)
            dk = dk.at[jc].add(jnp.einsum("bkgqs,bqkgh->bskh", ds, q_i))
            dv = dv.at[jc].add(jnp.einsum("bkgqs,bkgqh->bskh", p, do_i))
            return (dq_i, dk, dv), None

        (dq_i, dk, dv), _ = jax.lax.scan(key_block, (jnp.zeros(q_i.shape, f32), dk, dv), jnp.arange(span))
        return (dk, dv), dq_i

    zeros = jnp.zeros(kb.shape, f32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), jnp.arange(num_blocks))
    dq = _merge(dq).reshape(bsz, t + pad, n, h)[:, :t]
    dk, dv = _merge(dk)[:, :t], _merge(dv)[:, :t]
    seg_zero = np.zeros(np.shape(segment_ids), jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), seg_zero


_attention.defvjp(_attention_fwd, _attention_bwd)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                      window: int | None = None, block: int = BLOCK) -> jax.Array:
    """Causal attention inside each segment, blockwise with an online softmax.

    q: [B, T, N, H], already scaled as the model scales queries; k, v: [B, T, K, H] with N a multiple of K
    (query head n uses key head n // (N / K), Tunix's grouping); segment_ids: int [B, T]. window: the
    sliding window of a local layer (query t sees keys t - window < s <= t), None on global layers.
    block: the tile length; T need not be a multiple of it. Returns [B, T, N, H] in q's dtype; scores and
    the softmax are float32. Memory beyond the inputs is one [B, N, block, block] tile, forward and
    backward (the backward recomputes the tiles from the saved log-sum-exp).
    """
    return _attention(q, k, v, segment_ids, window, block, traced())


def splash_tiles(q: int, kv: int, fused: bool = False) -> dict:
    """A tiling of splash attention's kernels (the fields of its ``BlockSizes``): ``q`` query rows and ``kv`` key
    rows per tile in the forward kernel and the backward ones, dq's and dkv's or, ``fused``, one kernel for both."""
    tiles = dict(block_q=q, block_kv=kv, block_kv_compute=kv, block_q_dkv=q, block_kv_dkv=kv, block_kv_dkv_compute=kv)
    return dict(tiles, use_fused_bwd_kernel=True) if fused else dict(tiles, block_q_dq=q, block_kv_dq=kv)


SPLASH_BLOCKS = splash_tiles(512, 512, fused=True)
"""Splash attention's tiles on TPU: 512 query and key rows in the forward kernel and in the fused backward one. On
a v5e at the trained steps' shapes (bench/bench_splash.py, bench/splash.jsonl) 2.3 to 3.8 x faster forward and
backward than JAX's default 128-row tiles."""


SPLASH_TILE_BYTES = 512 * 256 * 4
"""The most of a head's rows one splash tile holds (rows x head width x bytes). The kernels' scoped VMEM is 16 MiB
on a v5e: 512 float32 rows of head width 512 at "highest" precision (a float32 recipe's on Gemma 4's global layers)
need 28 MiB in the fused backward kernel, where 512 float32 rows of width 256 and 512 bfloat16 rows of width 512
fit (libtpu's compile, on the chip and compile-only; ``tests/plan/test_tpu_compile.py``). Wider heads take fewer
rows: float32 at width 512, 256."""


def _splash(q, k, v, segment_ids, window, interpret=False, blocks=SPLASH_BLOCKS):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash  # lazy: TPU only
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib  # lazy: TPU only

    _, length, n, _ = q.shape
    kv_heads = k.shape[2]
    # A row shorter than a tile takes tiles of its own length, in the kernel's 128-row units, and a tile holds at
    # most SPLASH_TILE_BYTES of a head's rows.
    row = -(-length // 128) * 128
    fit = max(128, SPLASH_TILE_BYTES // (q.shape[-1] * q.dtype.itemsize) // 128 * 128)
    blocks = {name: min(b, row, fit) if name.startswith("block_") and b else b for name, b in blocks.items()}
    # The kernel's blocks must divide the row: pad it at the end. Causality keeps the padding out of every real
    # query's view, whatever its segment id, and the padded queries' outputs are dropped.
    block = max(b for name, b in blocks.items() if name.startswith("block_") and b)
    pad = -length % block
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    seg = jnp.pad(jnp.asarray(segment_ids, jnp.int32), ((0, 0), (0, pad)))
    t = length + pad
    if window is None:
        mask = mask_lib.CausalMask((t, t))
    else:
        mask = mask_lib.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    kernel = splash.make_splash_mqa_single_device(mask_lib.MultiHeadMask([mask] * (n // kv_heads)),
                                                    block_sizes=splash.BlockSizes(**blocks), interpret=interpret)
    # [B, T, K, G, H] -> [B, K, G, T, H]: one MQA kernel per KV head and its query group.
    qg = jnp.moveaxis(q.reshape(*q.shape[:2], kv_heads, n // kv_heads, q.shape[-1]), 1, 3)
    kt, vt = jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2)

    def row(q_r, k_r, v_r, s_r):
        ids = splash.SegmentIds(q=s_r, kv=s_r)
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(q_r, k_r, v_r)

    out = _mosaic_precision(jax.vmap(row))(qg, kt, vt, seg)  # [B, K, G, T, H]
    return jnp.moveaxis(out, 3, 1).reshape(q.shape)[:, :length].astype(q.dtype)


def _mosaic_precision(kernel):
    # Mosaic compiles a TPU kernel's products at JAX's default precision or "highest", not at "high" (three
    # bfloat16 passes, a tf32 recipe's: "Unsupported dot precision: HIGH"). Under "high" the kernel runs at
    # "highest", forward and backward: at least the precision the recipe asked for.
    if traced() != "high":
        return kernel

    def at_highest(*args):
        with jax.default_matmul_precision("highest"):
            return kernel(*args)

    @jax.custom_vjp
    def run(*args):
        return at_highest(*args)

    def backward(pull, d_out):
        with jax.default_matmul_precision("highest"):
            return pull(d_out)

    run.defvjp(lambda *args: jax.vjp(at_highest, *args), backward)
    return run


def _pallas_gpu(q, k, v, segment_ids, interpret=False):
    # JAX's Pallas GPU flash attention (Triton) takes segment ids and a causal mask, with as many KV heads as
    # query heads: GQA's KV heads are repeated for their query groups.
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # lazy: GPU only

    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    out = gpu_attention.mha(q, k, v, jnp.asarray(segment_ids, jnp.int32), sm_scale=1.0, causal=True,
                            interpret=interpret)
    return out.astype(q.dtype)


def _gpu_kernel_takes(t: int, window: int | None) -> bool:
    """Whether ``_pallas_gpu`` computes this layer: a global (causal) layer whose length every block of the
    kernel divides. It has no sliding window."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # lazy: GPU only

    blocks = [b for b in dataclasses.astuple(gpu_attention.BlockSizes.get_default()) if b]
    return window is None and all(t % min(b, t) == 0 for b in blocks)


def _on_mesh(kernel, q, k, v, segment_ids):
    # A Pallas kernel is opaque to XLA's partitioner, which would gather every input onto every device: under
    # a mesh each device runs the kernel on its own rows (fsdp) and KV heads with their query groups (tp), as
    # Tunix shards heads. An axis that does not divide rows or KV heads is left whole.
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(q, k, v, segment_ids)
    fsdp = FSDP if FSDP in mesh.axis_names and q.shape[0] % mesh.shape[FSDP] == 0 else None
    tp = TP if TP in mesh.axis_names and k.shape[2] % mesh.shape[TP] == 0 else None
    heads = P(fsdp, None, tp, None)
    specs = (heads, heads, heads, P(fsdp, None))
    args = (q, k, v, segment_ids)
    if all(t == AxisType.Explicit for t in mesh.axis_types):
        # On Explicit axes shard_map takes its inputs only as laid out by its specs (Auto ones it lays out).
        args = tuple(jax.reshard(x, spec) for x, spec in zip(args, specs))
    local = jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
    return local(*args)


def attend(q, k, v, segment_ids, window, block=BLOCK):
    """Segment attention on the fast kernel of the platform the trace compiles for (``gemport.mesh.tpu.platform``:
    the mesh's devices), shapes as ``segment_attention``: splash attention on TPU;
    on GPU, JAX's Pallas flash attention on global layers whose length its blocks divide; both on each
    device's rows and KV heads under a mesh. ``segment_attention`` everywhere else (CPU, GPU sliding layers)."""
    backend = platform()
    if backend == "tpu":
        return _on_mesh(functools.partial(_splash, window=window), q, k, v, segment_ids)
    if backend == "gpu" and _gpu_kernel_takes(q.shape[1], window):
        return _on_mesh(_pallas_gpu, q, k, v, segment_ids)
    return segment_attention(q, k, v, segment_ids, window=window, block=block)


def _segments(attn_mask):
    if attn_mask is None or jnp.ndim(attn_mask) != 2:
        raise BatchError(
            "a segment-attention model takes segment_ids int [B, T] where Tunix takes attention_mask; got "
            f"{None if attn_mask is None else jnp.shape(attn_mask)}"
        )
    return attn_mask


def _no_cache(cache):
    if cache is not None:
        raise BatchError("segment attention is for training (no KV cache); sample with the Tunix model")


@functools.cache
def _gemma4_class():
    from tunix.models.gemma4 import model as g4  # optional: tunix extra

    class SegmentAttention(g4.Attention):
        """Tunix Gemma 4 attention whose scores come from ``segment_attention`` (``attn_mask`` = segment_ids)."""

        def block(self, x, segment_pos, cache, attn_mask, kv_shared_cache=None):
            _no_cache(cache)
            cfg = self.config
            rope = functools.partial(g4.apply_rope, positions=segment_pos, base_frequency=self.rope_base_frequency,
                                     scale_factor=self.rope_scale_factor, rope_proportion=self.rope_proportion)
            x = x.astype(cfg.dtype)
            query = rope(upstream.query_norm(self)(g4.shard(self.q_einsum(x), cfg.shd_config.act_btnh)))
            if kv_shared_cache is not None:
                key, value = kv_shared_cache["k"], kv_shared_cache["v"]
            else:
                if hasattr(self, "k_einsum"):  # k_eq_v: one projection is both keys and values
                    key = value = self.k_einsum(x)
                else:
                    key, value = self.kv_einsum(x)
                key = g4.shard(key, cfg.shd_config.act_btnh)
                value = g4.shard(value, cfg.shd_config.act_btnh)
                value = value * jax.lax.rsqrt(jnp.mean(jnp.square(value), axis=-1, keepdims=True) + 1e-06)
                key = rope(upstream.key_norm(self)(key))
            window = cfg.sliding_window_size if self.attn_type == g4.AttentionType.LOCAL_SLIDING else None
            encoded = attend(query, key, value, _segments(attn_mask), window, self.segment_block)
            out = g4.shard(self.attn_vec_einsum(encoded), cfg.shd_config.act_btd)
            return {"k": key, "v": value}, out, (key, value)

    return g4.Attention, SegmentAttention


@functools.cache
def _gemma3_class():
    from tunix.models.gemma3 import model as g3  # optional: tunix extra

    class SegmentAttention(g3.Attention):
        """Tunix Gemma 3 attention whose scores come from ``segment_attention`` (``attn_mask`` = segment_ids)."""

        def block(self, x, segment_pos, cache, attn_mask):
            _no_cache(cache)
            shd = self.shd_config
            if self.use_qkv_einsum:
                query, key, value = self.qkv_einsum(x)
            else:
                query = self.q_einsum(x)
                key, value = self.kv_einsum(x)
            query, key, value = (g3.sharding_utils.shard(a, shd.act_btnh) for a in (query, key, value))
            rope = functools.partial(g3.apply_rope, positions=segment_pos, head_dim=self.head_dim,
                                     base_frequency=self.rope_base_frequency, scale_factor=self.rope_scale_factor)
            query = rope(upstream.query_norm(self)(query)) * self.query_pre_attn_scalar
            key = rope(upstream.key_norm(self)(key))
            window = self.sliding_window_size if self.attn_type == g3.AttentionType.LOCAL_SLIDING else None
            encoded = attend(query, key, value, _segments(attn_mask), window, self.segment_block)
            return None, g3.sharding_utils.shard(self.attn_vec_einsum(encoded), shd.act_btd)

    return g3.Attention, SegmentAttention


def _replacements():
    out = {}
    for make in (_gemma4_class, _gemma3_class):
        try:
            tunix_cls, ours = make()
        except ImportError:
            continue
        out[tunix_cls] = ours
    return out


def segment_attention_model(model: nnx.Module, *, block: int = BLOCK) -> nnx.Module:
    """A copy of a Tunix Gemma 3 / Gemma 4 model (LoRA and all) whose attention honours segments blockwise.

    The copy shares the arrays of ``model`` (gradients taken through it reach them) and is called as the
    Tunix model with ``segment_ids`` int [B, T] in place of ``attention_mask`` [B, T, S]:
    ``copy(tokens, positions, None, segment_ids)``. Training only: no KV cache. ``model`` is not changed.
    block: ``segment_attention``'s tile length (splash attention on TPU takes ``SPLASH_BLOCKS``).
    Raises SpecError for a model with no Tunix Gemma 3 / Gemma 4 attention.
    """
    copy = nnx.merge(*nnx.split(model))
    replacements = _replacements()
    found = False
    for _, module in nnx.iter_modules(copy):
        ours = replacements.get(type(module), type(module))
        if ours in replacements.values():
            module.__class__ = ours
            module.segment_block = block
            found = True
    if not found:
        raise SpecError(
            f"segment_attention_model: {type(model).__name__} has no Tunix Gemma 3 / Gemma 4 attention layer"
        )
    return copy


def segment_blind(model: nnx.Module) -> bool:
    """Whether ``model``'s own attention ignores segment ids: Tunix's ``use_flash_attention`` (splash with a
    plain causal or local mask), which lets the examples of a packed row see each other."""
    replacements = _replacements()
    return any(type(module) in replacements and getattr(getattr(module, "config", None), "use_flash_attention", False)
               for _, module in nnx.iter_modules(model))


def check_segments(model: nnx.Module, segment_ids: jax.typing.ArrayLike, where: str) -> None:
    """Refuse rows with more than one segment for a ``segment_blind`` model (``segment_ids`` int [..., T]).

    Raises BatchError naming ``where`` (the step or trainer) and the fix.
    """
    if not segment_blind(model):
        return
    ids = np.asarray(segment_ids)
    rows = ids.reshape(-1, ids.shape[-1])
    first = np.where(rows > 0, rows, np.iinfo(rows.dtype).max).min(axis=-1, keepdims=True)
    packed = ((rows > 0) & (rows != first)).any(axis=-1)
    if packed.any():
        raise BatchError(
            f"{where}: row {int(np.argmax(packed))} of the batch packs several examples (segment_ids), but the "
            "model was built with Tunix's use_flash_attention, whose splash attention ignores segments and would "
            "let them attend to each other; train with gemport's segment attention (the default), or build the "
            "model with use_flash_attention=False, or give one example per row"
        )

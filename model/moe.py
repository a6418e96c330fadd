"""The mixture-of-experts block: a router picks each token's experts, and each expert runs
on exactly the tokens sent to it (dropless), in shapes fixed by the step's token count.

Routing is transformers' for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE: router logits, a
softmax over every expert in float32, the k largest, divided by their sum where the model
renormalizes (`ModelConfig.norm_topk_prob`), each weight multiplying its expert's output
(in float32 or in the activations' dtype: `MoeFamily.float32_weights`). DeepSeek-V2/V3 and
GLM-4.5 route by the same function with their rules as data (`route`'s keywords: sigmoid
scores, a choice-only bias, expert groups, a scaling factor) and add ungated shared experts. gpt-oss picks the k
largest logits of a router with a bias and softmaxes those k in the activations' dtype; its
experts carry biases and gate with a clamped SwiGLU.

The experts' matmuls: the step's (token, slot) pairs sorted by expert, their rows gathered,
and one grouped matmul per projection over the sorted rows (quant/ops.grouped_matmul: on
CPUs our packed C++ kernels, on NVIDIA GPUs our Pallas kernel, `cfg.moe_backend` to
override), so which experts the tokens pick never changes a shape. The outputs go back to
(token, slot) order by the inverse permutation, a gather.

Tensor parallel (model/sharding.py): each expert's matmuls split like the dense MLP's, or,
expert parallel, each device holds whole experts and computes only their (token, slot)
pairs; either way the devices' partial sums meet in one psum at the end.
"""
from __future__ import annotations

from functools import reduce
from operator import add

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.layers import MLP, Linear, activation, init, reduce_shards
from model.rounding import rounded
from quant import ops as quant_ops


class ExpertLinear(nn.Module):
    """One [in, out] kernel per expert, stacked: kernel [E, in, out]; and a bias [E, out]
    where the family has them."""
    features: int
    num_experts: int
    param_dtype: str = "float32"
    use_bias: bool = False
    backend: str = "auto"  # quant/ops.py grouped_matmul's

    @nn.compact
    def __call__(self, rows, group_sizes, row_experts=None):
        """rows [M, in] sorted by expert, group_sizes int32[E] -> [M, out]. row_experts
        int32[M]: each row's expert, E for rows no expert here computes (they stay 0)."""
        w = self.param("kernel", init, (self.num_experts, rows.shape[-1], self.features),
                       self.param_dtype)
        y = quant_ops.grouped_matmul(rows, w, group_sizes, self.backend)
        if self.use_bias:
            b = self.param("bias", nn.initializers.zeros, (self.num_experts, self.features),
                           self.param_dtype)
            ours = (row_experts < self.num_experts)[:, None]
            y = y + jnp.where(ours, b[jnp.minimum(row_experts, self.num_experts - 1)],
                              0).astype(y.dtype)
        return y


def _sum_columns(x):
    """x [T, n] -> [T]: column 0 + column 1 + ..., left to right, the same order whatever T
    is (XLA:CPU's row reduction of [T, n] picks an order by T)."""
    return reduce(add, [x[:, j] for j in range(x.shape[1])])


def route(logits, k: int, renormalize: bool, *, sigmoid: bool = False, bias=None,
          groups: int = 1, topk_groups: int = 1, group_top2: bool = False,
          scale: float = 1.0):
    """logits [T, E] -> (weights float32[T, k], experts int32[T, k]): each token's k best
    experts. Scores are a softmax in float32 as transformers computes it (its sums in a
    fixed order, so a token's weights and, at a near tie, its experts do not move with its
    batch: docs/architecture.md, "Batch invariance"), or, DeepSeek-V3's, sigmoids.

    DeepSeek's rules (ModelConfig's router fields): `bias` float32[E] is added to the
    scores for choosing alone; with `groups` > 1 the experts fall in equal groups, each
    scored by its best expert's score (or, `group_top2`, its two best's sum), and only the
    `topk_groups` best groups' experts may be chosen. The weights are the chosen experts'
    unbiased scores, divided by their sum where `renormalize`, times `scale`."""
    logits = logits.astype(jnp.float32)
    if sigmoid:
        scores = jax.nn.sigmoid(logits)
    else:
        e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        scores = e / _sum_columns(e)[:, None]
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if groups > 1:
        choice = _best_groups(choice, groups, topk_groups, group_top2)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if renormalize:
        weights = weights / (_sum_columns(weights)[:, None] + (1e-20 if sigmoid else 0.0))
    if scale != 1.0:
        weights = weights * jnp.float32(scale)
    return weights, experts.astype(jnp.int32)


def _best_groups(choice, groups: int, keep: int, top2: bool):
    """choice [T, E] with every expert outside its token's `keep` best groups at -inf."""
    T, E = choice.shape
    grouped = choice.reshape(T, groups, E // groups)
    if top2:
        best = jax.lax.top_k(grouped, 2)[0]
        score = best[..., 0] + best[..., 1]
    else:
        score = jnp.max(grouped, axis=-1)
    _, kept = jax.lax.top_k(score, keep)  # [T, keep]
    mask = jnp.any(kept[:, :, None] == jnp.arange(groups)[None, None, :], axis=1)
    return jnp.where(jnp.repeat(mask, E // groups, axis=1), choice, -jnp.inf)


def route_topk_softmax(logits, k: int):
    """gpt-oss: the k largest logits, softmaxed among themselves in the logits' dtype (as
    transformers does), their sum in a fixed order."""
    top, experts = jax.lax.top_k(logits, k)
    e = jnp.exp(top - top[:, :1])  # top_k sorts: column 0 is the largest
    return e / _sum_columns(e)[:, None], experts.astype(jnp.int32)


def dispatch(experts, num_experts: int):
    """experts int32[T, k] -> (order int32[T*k]: the flattened (token, slot) pairs sorted by
    expert, token order kept within an expert; inverse int32[T*k]: where each pair went;
    group_sizes int32[E]: how many pairs each expert got)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, sizes


def local_expert_ids(experts, local: int, shard):
    """Expert parallel: global expert ids -> this shard's (experts [shard * local, (shard + 1)
    * local) as 0 .. local - 1), every other expert as `local`, a group sorted after this
    shard's: its rows lie past the groups the grouped matmul computes, so they come out zero
    and the psum over shards adds each (token, expert) pair's output once."""
    ids = experts - shard * local
    return jnp.where((ids >= 0) & (ids < local), ids, local).astype(jnp.int32)


def clamped_swiglu(gate, up, limit: float, alpha: float):
    """gpt-oss's gate: the gate clamped above, up clamped both ways and shifted by one."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * nn.sigmoid(gate * alpha))


def _expert_mlp(rows, sizes, ids, lin, joined: bool, cfg: ModelConfig):
    """Every sorted row through its expert's MLP: rows [M, H] -> [M, H]."""
    n = cfg.moe_intermediate_size
    if not cfg.moe_family.gated_experts:  # act(up), no gate (Nemotron-H)
        h = activation(cfg.hidden_act)(lin(n, "up_proj")(rows, sizes, ids))
        return lin(rows.shape[-1], "down_proj")(h, sizes, ids)
    if joined:  # gate and up joined at load, as the dense MLP's
        gate, up = jnp.split(lin(2 * n, "gate_up_proj")(rows, sizes, ids), 2, axis=-1)
    else:
        gate, up = (lin(n, "gate_proj")(rows, sizes, ids),
                    lin(n, "up_proj")(rows, sizes, ids))
    if cfg.swiglu_limit:
        h = clamped_swiglu(gate, up, cfg.swiglu_limit, cfg.swiglu_alpha)
    else:
        h = nn.silu(gate) * up
    return lin(cfg.hidden_size, "down_proj")(h, sizes, ids)


def weighted_slots(out, weights, float32_weights: bool) -> list:
    """out [T, k, H] (each token's experts' outputs), weights float32[T, k] -> k products
    [T, H] in the activations' dtype, as transformers rounds them."""
    if float32_weights:
        prods = (out.astype(jnp.float32) * weights[..., None]).astype(out.dtype)
    else:
        prods = out * weights.astype(out.dtype)[..., None]
    return [prods[:, j] for j in range(prods.shape[1])]


def _sum_unfused(*terms):
    """The products rounded before any sum (model/rounding.py)."""
    return reduce(add, rounded(terms))


def sum_in_order(terms: list):
    """terms[0] + terms[1] + ..., left to right, whatever the batch."""
    return jax.lax.platform_dependent(*terms, cpu=_sum_unfused,
                                      default=lambda *t: reduce(add, t))


class MoE(nn.Module):
    cfg: ModelConfig
    axis: str | None = None  # tensor parallel: the mesh axis the partial sums meet on

    @nn.compact
    def __call__(self, x):
        """x [T, H] -> [T, H]."""
        cfg = self.cfg
        if cfg.moe_token_axis is not None:
            return self._gathered(x, cfg.moe_token_axis)
        return reduce_shards(self._routed(x, self.axis, shared=True), self.axis)

    def _gathered(self, x, axis: str):
        """Data-parallel attention: every device's tokens through this device's experts,
        each device's sums scattered back to it; the shared expert (whole on every device)
        on its own tokens, added last as on one device."""
        mine = jax.lax.psum_scatter(self._routed(jax.lax.all_gather(x, axis, tiled=True), axis,
                                                 shared=False),
                                    axis, scatter_dimension=0, tiled=True)
        if not self.cfg.shared_expert_intermediate_size:
            return mine
        return sum_in_order([mine, self._shared(x)])

    def _routed(self, x, axis: str | None, shared: bool):
        """The weighted sum of x's routed experts that live on this device (and the shared
        expert's output, when `shared`), summed in slot order."""
        cfg = self.cfg
        T, k, family = x.shape[0], cfg.num_experts_per_tok, cfg.moe_family
        if family.topk_then_softmax:
            logits = Linear(cfg.num_experts, family.biases, cfg.dtype, name="router")(x)
            weights, experts = route_topk_softmax(logits, k)
        elif family.deepseek_router:
            weights, experts = self._deepseek_route(x)
        else:
            logits = Linear(cfg.num_experts, family.biases, cfg.dtype, name="router")(x)
            weights, experts = route(logits, k, cfg.norm_topk_prob)
        local = cfg.local_experts
        if local < cfg.num_experts:  # expert parallel: this shard's experts alone
            experts = local_expert_ids(experts, local, jax.lax.axis_index(axis))
        # group `local` (empty unless expert parallel) holds other shards' pairs: cut off
        order, inverse, sizes = dispatch(experts, local + 1)
        sizes = sizes[:local]
        ids = experts.reshape(-1)[order] if family.biases else None  # each sorted row's
        lin = lambda n, name: ExpertLinear(n, local, cfg.dtype, family.biases,
                                           cfg.moe_backend, name=name)
        rows = x
        if cfg.moe_latent_size:  # Nemotron-H's latent experts: in and out of a narrower width
            rows = Linear(cfg.moe_latent_size, cfg.mlp_bias, cfg.dtype, name="latent_in")(x)
        out = _expert_mlp(rows[order // k], sizes, ids, lin,
                          self.has_variable("params", "gate_up_proj"), cfg)
        terms = weighted_slots(out[inverse].reshape(T, k, -1), weights,
                               family.float32_weights)
        if cfg.moe_latent_size:
            terms = [Linear(cfg.hidden_size, cfg.mlp_bias, cfg.dtype, name="latent_out")(
                sum_in_order(terms))]
        if shared and cfg.shared_expert_intermediate_size:
            terms.append(self._shared(x))
        return sum_in_order(terms)

    def _deepseek_route(self, x):
        """The router in float32, its weight and bias kept in float32 as transformers keeps
        them (a bfloat16 score can flip a choice that the bias decides)."""
        cfg = self.cfg
        logits = Linear(cfg.num_experts, False, "float32", name="router")(
            x.astype(jnp.float32))
        bias = (self.param("router_bias", nn.initializers.normal(0.02), (cfg.num_experts,),
                           jnp.float32) if cfg.router_bias else None)
        return route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                     sigmoid=cfg.router_sigmoid, bias=bias, groups=cfg.router_groups,
                     topk_groups=cfg.router_topk_groups, group_top2=cfg.router_group_top2,
                     scale=cfg.routed_scaling_factor)

    def _shared(self, x):
        cfg = self.cfg
        shared = MLP(cfg, None, cfg.shared_expert_intermediate_size, name="shared_expert")(x)
        if not cfg.moe_family.shared_gate:
            return shared  # DeepSeek's shared experts, Granite's shared MLP: added as they are
        gate = Linear(1, False, cfg.dtype, name="shared_expert_gate")(x)
        return nn.sigmoid(gate) * shared

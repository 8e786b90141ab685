"""Bytes read per decode token and FLOPs per prefill token of a loaded model: the denominators
of the roofline ratios in `bench latency`.

The model's weights are its `state_dict` tensors (parameters and persistent buffers, each
counted once even if tied), at their stored dtype, so MXFP4-packed experts count 0.5 B/weight
plus scales and dequantized ones 2 B/weight, whatever the loader chose. Invariant: the model
holds each weight once (a second, fused copy of a weight would be counted twice).

Decode (one sequence, one token, at `context` cached tokens), bytes read:
- every weight except the embedding and the routed experts, in full (router, shared experts,
  dense MLP, attention, norms, `lm_head`); one embedding row;
- per MoE layer, `top_k` routed experts at their stored size (the layer's expert tensors ÷ E);
- per MLA layer, `context` latent rows; per KDA layer, the recurrent state and the conv tail
  (reads only; the state write-back is not counted).

Prefill (a prompt of L tokens in one sequence), FLOPs per token:
- 2 × elements of every weight matrix (≥ 2-D: linears, conv, AttnRes projections) except the
  embedding, `lm_head` and routed experts; 2 × `top_k` × 3 × I × Din per MoE layer;
- `lm_head` once per prompt (only the last position is sampled): 2 × V × D ÷ L;
- MLA (plain form, causal): QKᵀ and PV over (L + 1) / 2 keys on average: 2 H (dqk + dv) (L+1)/2;
- KDA, chunked (WY / UT) form with chunk C = min(64, L), per head: intra-chunk Akk, Aqk and
  w = T·βk (6 C K), u = T·βv and the intra-chunk output (4 C V), the triangular inverse (C²/3),
  and the state terms q·S, w·S, kᵀ·v_new (6 K V). Element-wise work is not counted.

A decode step of n sequences (`decode_step`, the denominators of `bench throughput`'s roofline):
- bytes: every weight but the routed experts once, n embedding rows, per MoE layer the expected
  number of distinct experts n tokens choose (each `top_k` distinct of E, uniformly:
  E (1 - (1 - k/E)^n), exactly k at n = 1), and each sequence's MLA rows and KDA state as above;
- FLOPs per token: the prefill's dense and routed terms, the whole `lm_head` (2 V D), MLA in the
  absorbed form over `context` latent rows (scores over the latent and rope width, values over the
  latent: 2 H (latent + rope + latent) per row), KDA's recurrent update per head (decay, S k,
  the rank-1 update, S q: 7 K V).
At n = 1 the bytes are `decode_bytes`' total.
"""

from __future__ import annotations

KDA_CHUNK = 64


def _key(t) -> tuple:
    """Identity of a tensor's data: tied weights share it."""
    return (t.data_ptr(), t.nbytes, t.dtype)


def _weights(model) -> dict[str, object]:
    """state_dict name -> tensor, one name per distinct tensor (ties dropped)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if _key(t) not in seen:
            seen.add(_key(t))
            out[name] = t
    return out


def _expert_prefixes(cfg) -> list[str]:
    return [f"model.layers.{i}.block_sparse_moe.experts." for i, moe in enumerate(cfg.moe_layers) if moe]


def _is_expert(name: str, prefixes: list[str]) -> bool:
    return any(name.startswith(p) for p in prefixes)


def decode_bytes(
    model, context: int, kv_itemsize: int, state_itemsize: int = 4, tail_itemsize: int | None = None
) -> dict:
    """Bytes read to decode one token at `context` cached tokens (see module docstring).
    `kv_itemsize`: MLA latent cache element size; `state_itemsize`/`tail_itemsize`: KDA state
    and conv-tail element sizes (tail defaults to `kv_itemsize`)."""
    cfg = model.config
    tail_itemsize = kv_itemsize if tail_itemsize is None else tail_itemsize
    weights = _weights(model)
    prefixes = _expert_prefixes(cfg)
    emb = model.model.embed_tokens.weight
    head = model.lm_head.weight
    tied = _key(emb) == _key(head)
    dense = experts = 0
    for name, t in weights.items():
        k = _key(t)
        if _is_expert(name, prefixes):
            experts += t.nbytes
        elif k != _key(emb) and k != _key(head):
            dense += t.nbytes
    n_moe = len(prefixes)
    routed = experts * cfg.moe.top_k // cfg.moe.num_experts if n_moe else 0
    emb_row = 0 if tied else emb.nbytes // emb.shape[0]
    k = cfg.kda
    mla = len(cfg.mla_layer_ids) * context * cfg.mla.latent_dim * kv_itemsize
    kda = len(cfg.kda_layer_ids) * (
        k.num_heads * k.head_dim * k.head_dim * state_itemsize + (k.conv_kernel - 1) * 3 * k.proj_dim * tail_itemsize
    )
    weights_total = dense + emb_row + head.nbytes + routed
    return {
        "dense_weight_bytes": dense,
        "embedding_row_bytes": emb_row,
        "lm_head_bytes": head.nbytes,
        "routed_expert_bytes": routed,
        "weight_bytes": weights_total,
        "mla_cache_bytes": mla,
        "kda_state_bytes": kda,
        "context": context,
        "total_bytes": weights_total + mla + kda,
    }


def kda_flops_per_head(chunk: int, k: int, v: int) -> float:
    return 6 * chunk * k + 4 * chunk * v + chunk * chunk / 3 + 6 * k * v


def _dense_and_routed_flops(model) -> tuple[int, int]:
    """FLOPs a token spends in the weight matrices outside the embedding and `lm_head`: (the
    dense ones, its `top_k` routed experts)."""
    cfg = model.config
    prefixes = _expert_prefixes(cfg)
    emb, head = _key(model.model.embed_tokens.weight), _key(model.lm_head.weight)
    dense = sum(
        2 * t.numel()
        for name, t in _weights(model).items()
        if t.dim() >= 2 and t.is_floating_point() and not _is_expert(name, prefixes) and _key(t) not in (emb, head)
    )
    m = cfg.moe
    return dense, len(prefixes) * m.top_k * 2 * 3 * m.intermediate_size * (m.latent_size or cfg.hidden_size)


def prefill_flops(model, prompt_len: int, chunk: int = KDA_CHUNK) -> dict:
    """FLOPs per token of a `prompt_len`-token prefill (see module docstring)."""
    if prompt_len < 1:
        raise ValueError("prompt_len must be positive")
    cfg = model.config
    dense, routed = _dense_and_routed_flops(model)
    lm_head = 2 * model.lm_head.weight.numel() / prompt_len
    a = cfg.mla
    mla = len(cfg.mla_layer_ids) * 2 * a.num_heads * (a.qk_head_dim + a.v_head_dim) * (prompt_len + 1) / 2
    c = min(chunk, prompt_len)
    kda = len(cfg.kda_layer_ids) * cfg.kda.num_heads * kda_flops_per_head(c, cfg.kda.head_dim, cfg.kda.head_dim)
    return {
        "dense_flops": dense,
        "routed_expert_flops": routed,
        "lm_head_flops": lm_head,
        "mla_attention_flops": mla,
        "kda_flops": kda,
        "prompt_len": prompt_len,
        "total_flops": dense + routed + lm_head + mla + kda,
    }


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts among `tokens` tokens that each choose `top_k` distinct experts
    of `num_experts` uniformly at random."""
    if tokens < 1:
        raise ValueError("tokens must be positive")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_step(
    model, seqs: int, context: int, kv_itemsize: int, state_itemsize: int = 4, tail_itemsize: int | None = None
) -> dict:
    """Bytes read and FLOPs of one decode step of `seqs` sequences at `context` cached tokens each
    (see module docstring); sizes as `decode_bytes`."""
    if seqs < 1:
        raise ValueError("seqs must be positive")
    one = decode_bytes(model, context, kv_itemsize, state_itemsize, tail_itemsize)
    cfg = model.config
    m = cfg.moe
    experts = expected_experts(m.num_experts, m.top_k, seqs) if one["routed_expert_bytes"] else 0.0
    routed_bytes = one["routed_expert_bytes"] * experts / m.top_k
    per_seq = one["embedding_row_bytes"] + one["mla_cache_bytes"] + one["kda_state_bytes"]
    weights_once = one["dense_weight_bytes"] + one["lm_head_bytes"]
    dense, routed = _dense_and_routed_flops(model)
    a, k = cfg.mla, cfg.kda
    mla = len(cfg.mla_layer_ids) * 2 * a.num_heads * (a.latent_dim + a.kv_lora_rank) * context
    kda = len(cfg.kda_layer_ids) * k.num_heads * 7 * k.head_dim * k.head_dim
    per_token = dense + routed + 2 * model.lm_head.weight.numel() + mla + kda
    return {
        "seqs": seqs,
        "context": context,
        "distinct_experts_per_layer": experts,
        "weight_bytes": weights_once,
        "routed_expert_bytes": routed_bytes,
        "sequence_bytes": seqs * per_seq,
        "total_bytes": weights_once + routed_bytes + seqs * per_seq,
        "flops_per_token": per_token,
        "total_flops": seqs * per_token,
    }


def roofline_seconds(nbytes: float, flops: float, bandwidth_gb_s: float, gflops: float) -> float:
    """The least time a pass reading `nbytes` and computing `flops` can take on a machine of these
    limits (memory and compute overlapped)."""
    return max(nbytes / (bandwidth_gb_s * 1e9), flops / (gflops * 1e9))


def cache_itemsizes(llm) -> dict:
    """Element sizes of the engine's MLA latent pool, KDA state and conv-tail pools."""
    return {
        "kv_itemsize": llm.cache.mla.storage.element_size(),
        "state_itemsize": llm.cache.kda.states.element_size(),
        "tail_itemsize": llm.cache.kda.tails.element_size(),
    }

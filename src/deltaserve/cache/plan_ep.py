"""Wide expert parallelism in the memory plan (`--data-parallel-size D --enable-expert-parallel`):
what each rank sends per step in the MoE all-to-alls (ops/moe_a2a.py).

Per MoE layer a rank sends each of its tokens' k (token, expert) rows, `latent_size` (K3) or
`hidden_size` wide in the model dtype, to the ranks holding those experts (dispatch) and gets
their outputs back (combine, the same bytes the other way), after exchanging its per-expert
counts (E int64). Rows for the rank's own experts stay local: under uniform routing a share
(W - 1) / W of the rows leaves the rank, W = D x TP. With TP > 1 inside a replica each TP rank
dispatches its share, ceil(N / TP) of the replica's N tokens, and sends its routed rows (one per
token, the same width) to the replica's other TP - 1 ranks in the all-gather that follows. Bytes
are what one rank sends (it receives about as much)."""

from __future__ import annotations

from fractions import Fraction

from ..model.config import ModelConfig


def all_to_all(
    cfg: ModelConfig, ranks: int, itemsize: int, decode_tokens: int, prefill_tokens: int, tp: int = 1
) -> dict:
    """The all-to-all section of the plan for experts split over `ranks` ranks, replicas of `tp`
    ranks; a decode step is `decode_tokens` tokens per replica (--max-num-seqs), a prefill step
    `prefill_tokens` (--max-num-batched-tokens)."""
    m = cfg.moe
    row = (m.latent_size or cfg.hidden_size) * itemsize
    layers = sum(cfg.moe_layers)
    per_token = 2 * m.top_k * row  # dispatch + combine, per MoE layer
    remote = Fraction(ranks - 1, ranks)
    counts = m.num_experts * 8

    def step(tokens: int) -> dict:
        mine = -(-tokens // tp)  # this TP rank's share of the replica's tokens
        return {
            "tokens": tokens,
            "tokens_per_rank": mine,
            "bytes": int(mine * layers * per_token * remote) + layers * counts,
            "tp_gather_bytes": mine * row * (tp - 1) * layers,
        }

    return {
        "ranks": ranks,
        "tensor_parallel_size": tp,
        "moe_layers": layers,
        "row_bytes": row,
        "bytes_per_token_per_layer": per_token,
        "remote_fraction": float(remote),
        "counts_bytes_per_layer": counts,
        "decode_step": step(decode_tokens),
        "prefill_step": step(prefill_tokens),
    }

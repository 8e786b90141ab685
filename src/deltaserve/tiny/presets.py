"""Sizes of the random-weight checkpoints `make_tiny` writes (spec/model.md §1.2, §12).

Presets (`mini` params count routed experts at their logical bf16 size):

| preset | family | D | layers (MLA, 0-based) | KDA H×d | MLA H, q/kv rank | experts (top-k, shared) | params |
|---|---|---|---|---|---|---|---|
| tiny | kimi_k3 | 64 | 5 (3, 4) | 2×32 | 2, 32/32 | 8×32 (4, 2), latent 32 | 0.62M |
| tiny | kimi_linear | 96 | 6 (3, 5) | 2×32 | 2, -/32 | 8×32 (2, 1) | 1.04M |
| mini | kimi_k3 | 1024 | 17 (3, 7, 11, 15, 16) | 8×128 | 8, 384/512 | 64×512 (8, 2), latent 512 | 1.04B |
| mini | kimi_linear | 768 | 13 (3, 7, 11, 12) | 6×128 | 6, -/512 | 64×256 (8, 1) | 0.55B |
| small | kimi_k3 | 128 | 6 (3, 5) | 4×32 | 4, 64/64 | 32×64 (4, 1), latent 64, MXFP4 | 1.7M |
| small | kimi_linear | 128 | 6 (3, 5) | 4×32 | 4, -/64 | 32×64 (4, 1) | 2.0M |

`small` is the size `deltaserve train-tiny` trains (the shipped default models): its tokenizer has
single-digit numbers (`single_digits`: no multi-digit BPE tokens, so arithmetic is per digit) and bare
words (`bare_words`: no token glues a space or punctuation to a letter, so a name is the same tokens
in a message and in a tool call's JSON `"..."`, and copying it is an exact token copy).

Layer pattern: 1-based MLA layers = every 4th layer plus the last; the rest are KDA (§1.2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FAMILIES = ("kimi_k3", "kimi_linear")


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    vocab: int
    kda_heads: int
    kda_head_dim: int
    mla_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    intermediate: int
    experts: int
    top_k: int
    shared: int
    moe_intermediate: int
    latent: int | None  # K3 routed_expert_hidden_size; None: experts at D
    attn_res_block: int | None
    shard_bytes: int
    mxfp4: bool  # default when make_tiny(mxfp4=None)
    single_digits: bool = False  # tokenizer without multi-digit tokens (tokenizer.base_ranks_lines)
    bare_words: bool = False  # tokenizer without space/punctuation-glued word tokens (same)

    @property
    def full_attn_layers(self) -> list[int]:
        return sorted(set(range(4, self.layers + 1, 4)) | {self.layers})

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(1, self.layers + 1) if i not in self.full_attn_layers]


_K3_TINY = Dims(
    hidden=64,
    layers=5,
    vocab=2048,
    kda_heads=2,
    kda_head_dim=32,
    mla_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope=16,
    qk_rope=8,
    v_head=16,
    intermediate=192,
    experts=8,
    top_k=4,
    shared=2,
    moe_intermediate=32,
    latent=32,
    attn_res_block=2,
    shard_bytes=1 << 20,
    mxfp4=False,
)
_KL_TINY = Dims(
    hidden=96,
    layers=6,
    vocab=2048,
    kda_heads=2,
    kda_head_dim=32,
    mla_heads=2,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope=16,
    qk_rope=8,
    v_head=16,
    intermediate=192,
    experts=8,
    top_k=2,
    shared=1,
    moe_intermediate=32,
    latent=None,
    attn_res_block=None,
    shard_bytes=1 << 20,
    mxfp4=False,
)
_K3_MINI = Dims(
    hidden=1024,
    layers=17,
    vocab=32768,
    kda_heads=8,
    kda_head_dim=128,
    mla_heads=8,
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_head=128,
    intermediate=2816,
    experts=64,
    top_k=8,
    shared=2,
    moe_intermediate=512,
    latent=512,
    attn_res_block=4,
    shard_bytes=256 << 20,
    mxfp4=True,
)
_KL_MINI = Dims(
    hidden=768,
    layers=13,
    vocab=32768,
    kda_heads=6,
    kda_head_dim=128,
    mla_heads=6,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_head=128,
    intermediate=2048,
    experts=64,
    top_k=8,
    shared=1,
    moe_intermediate=256,
    latent=None,
    attn_res_block=None,
    shard_bytes=256 << 20,
    mxfp4=False,
)
_K3_SMALL = Dims(
    hidden=128,
    layers=6,
    vocab=2048,
    kda_heads=4,
    kda_head_dim=32,
    mla_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope=32,
    qk_rope=16,
    v_head=32,
    intermediate=384,
    experts=32,
    top_k=4,
    shared=1,
    moe_intermediate=64,
    latent=64,
    attn_res_block=2,
    shard_bytes=4 << 20,
    mxfp4=True,
    single_digits=True,
    bare_words=True,
)
_KL_SMALL = dataclasses.replace(_K3_SMALL, q_lora_rank=None, top_k=4, latent=None, attn_res_block=None, mxfp4=False)
PRESETS = {
    ("kimi_k3", "tiny"): _K3_TINY,
    ("kimi_linear", "tiny"): _KL_TINY,
    ("kimi_k3", "mini"): _K3_MINI,
    ("kimi_linear", "mini"): _KL_MINI,
    ("kimi_k3", "small"): _K3_SMALL,
    ("kimi_linear", "small"): _KL_SMALL,
}

# K3's vision tower at tiny sizes, whatever the preset (the text model never reads it)
VISION = dict(
    vt_hidden_size=32,
    mm_hidden_size=32,
    vt_num_hidden_layers=2,
    vt_num_attention_heads=2,
    qkv_hidden_size=48,
    vt_intermediate_size=64,
    patch_size=14,
    merge_kernel_size=[2, 2],
    merge_type="sd2_tpool",
    mm_projector_type="patchmergerv2",
    projector_hidden_act="gelu",
    projector_ln_eps=1e-5,
    activation_func="gelu_pytorch_tanh",
    norm_type="rmsnorm",
    init_pos_emb_height=4,
    init_pos_emb_width=4,
    pos_emb_interpolation_mode="bilinear",
)

# K3's `preprocessor_config.json` `media_proc_cfg` at the spec's values (§12.1; OQ-7), the same
# for every preset; patch and merge sizes agree with VISION
MEDIA_PROC_CFG = dict(
    patch_size=VISION["patch_size"],
    merge_kernel_size=VISION["merge_kernel_size"][0],
    in_patch_limit=65536,
    patch_limit_on_one_side=512,
    fixed_output_tokens=None,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    transparent_bg_config=dict(
        pattern="chessboard",
        chessboard_square_size=8,
        chessboard_square_on_top_left=True,
        chessboard_white_value=255,
        chessboard_gray_value=180,
    ),
    transparent_bg_fill_stage="after_resize",
)

"""Chat templating: OpenAI-style messages -> prompt token ids (spec/model.md §13-14).

`render.py` is the entry point (`render_chat`, `load_chat_template`) and picks the format by
model family; `k3.py` (K3 "XTML") and `kimi_linear.py` (`<|im_*|>`, or the checkpoint's jinja
template in a sandbox) write the formats; `common.py` holds what they share (`ChatFormatError`,
`Special`, `encode_pieces`, validation). The format modules import only `common`.
"""

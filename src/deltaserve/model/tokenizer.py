"""Kimi tiktoken tokenizer (spec/model.md §13).

Invariants:
- ids `0 .. n_base-1` are the BPE ranks of `tiktoken.model`; ids `n_base .. n_base+255` are the
  256 reserved specials, named from `tokenizer_config.json` `added_tokens_decoder`, the rest
  `<|reserved_token_{id}|>`. `vocab_size == n_base + 256`.
- `eos_token_id` / `stop_token_ids` are the MODEL's stop ids (generation_config.json, else
  config.json), never the tokenizer class's own `eos_token` (`[EOS]`, the §13 pitfall).
- `encode` treats special-token strings in text as plain text unless `allow_special=True`
  (§18 item 21); long texts are cut exactly as the reference does (≤ 400,000-character pieces,
  runs of > 25,000 whitespace / non-whitespace characters split) so ids match it.
- `decode*` never raise on byte content (`errors="replace"`); out-of-range ids raise.
- Files are parsed as text/JSON only (no pickle, no eval).
"""

from __future__ import annotations

import base64
import binascii
import json
import operator
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import tiktoken

NUM_RESERVED = 256
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

_RUNS = re.compile(r"\s+|\S+")


class TokenizerError(ValueError):
    """Missing or malformed tokenizer files, or ids outside the vocabulary."""


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise TokenizerError(f"tokenizer file {path} is missing")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _read_ranks(path: Path) -> dict[bytes, int]:
    """Parse `base64(token) rank` lines; ranks must be exactly 0..n-1 and tokens distinct."""
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} is missing")
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError("expected 2 fields")
                tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error) as e:
                raise TokenizerError(f"{path}:{lineno}: malformed line ({e})") from e
            if rank != len(ranks) or tok in ranks:
                raise TokenizerError(
                    f"{path}:{lineno}: rank {rank} is out of order or its token "
                    f"is duplicated (expected rank {len(ranks)})"
                )
            ranks[tok] = rank
    if not ranks:
        raise TokenizerError(f"{path} holds no ranks")
    return ranks


def _int_ids(value, what: str) -> list[int]:
    vals = value if isinstance(value, list) else [value]
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise TokenizerError(f"{what} must be an int or a non-empty list of ints, got {value!r}")
    return vals


def _split_runs(text: str) -> Iterator[str]:
    """Pieces of ≤ MAX_ENCODE_CHARS characters, each run of whitespace / non-whitespace longer
    than MAX_RUN_CHARS cut every MAX_RUN_CHARS characters (the reference's slicing)."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start : start + MAX_ENCODE_CHARS]
        prev = 0
        for m in _RUNS.finditer(chunk):
            for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
                yield chunk[prev:cut]
                prev = cut
        yield chunk[prev:]


class Tokenizer:
    """tiktoken BPE plus 256 reserved specials; see the module docstring for invariants."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        special_names: dict[int, str],
        eos_token_ids: list[int],
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
        name: str = "kimi",
    ):
        self.n_base = len(mergeable_ranks)
        self.vocab_size = self.n_base + NUM_RESERVED
        names = {i: f"<|reserved_token_{i}|>" for i in range(self.n_base, self.vocab_size)}
        for i, n in special_names.items():
            if not self.n_base <= i < self.vocab_size:
                raise TokenizerError(
                    f"special token {n!r} has id {i}, outside the reserved range [{self.n_base}, {self.vocab_size})"
                )
            names[i] = n
        self.special_tokens: dict[str, int] = {n: i for i, n in names.items()}
        if len(self.special_tokens) != NUM_RESERVED:
            raise TokenizerError("special token names are not unique")
        for what, ids in (
            ("eos_token_id", eos_token_ids),
            ("bos_token_id", [bos_token_id]),
            ("pad_token_id", [pad_token_id]),
        ):
            for i in ids:
                if i is not None and not 0 <= i < self.vocab_size:
                    raise TokenizerError(f"{what} {i} is outside the vocabulary [0, {self.vocab_size})")
        if not eos_token_ids:
            raise TokenizerError("at least one eos_token_id is required")
        self.eos_token_id: int = eos_token_ids[0]
        self.stop_token_ids: set[int] = set(eos_token_ids)
        self.bos_token_id: int | None = bos_token_id
        self.pad_token_id: int | None = pad_token_id
        self.special_ids: frozenset[int] = frozenset(names)
        self._bytes: list[bytes] = [b""] * self.vocab_size
        for tok, rank in mergeable_ranks.items():
            self._bytes[rank] = tok
        for i, n in names.items():
            self._bytes[i] = n.encode("utf-8")
        self._ranks = mergeable_ranks
        try:
            self.encoding = tiktoken.Encoding(
                name=name, pat_str=KIMI_PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens
            )
        except ValueError as e:
            raise TokenizerError(f"tiktoken rejected the vocabulary: {e}") from e

    @classmethod
    def from_pretrained(cls, model_dir) -> "Tokenizer":
        """Load `tiktoken.model` + `tokenizer_config.json`; the stop ids come from
        `generation_config.json` `eos_token_id`, else `config.json` (top level or `text_config`)."""
        d = Path(model_dir)
        if not d.is_dir():
            raise TokenizerError(f"model directory {d} does not exist")
        ranks = _read_ranks(d / "tiktoken.model")
        tcfg = _read_json(d / "tokenizer_config.json", required=True)
        decoder = tcfg.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise TokenizerError("tokenizer_config.json added_tokens_decoder must be an object")
        specials: dict[int, str] = {}
        for key, entry in decoder.items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not isinstance(content, str) or not content or not key.isdigit():
                raise TokenizerError(f"tokenizer_config.json added_tokens_decoder[{key!r}] is malformed")
            specials[int(key)] = content
        sources = [
            _read_json(d / "generation_config.json", required=False),
            _read_json(d / "config.json", required=False),
        ]
        cfg = sources[1] or {}
        if isinstance(cfg.get("text_config"), dict):
            sources.append(cfg["text_config"])
        found = {
            k: next((s[k] for s in sources if s and s.get(k) is not None), None)
            for k in ("eos_token_id", "bos_token_id", "pad_token_id")
        }
        if found["eos_token_id"] is None:
            raise TokenizerError(
                f"no eos_token_id in {d}/generation_config.json or config.json; "
                "the model's stop id cannot be taken from the tokenizer's [EOS]"
            )
        eos = _int_ids(found["eos_token_id"], "eos_token_id")
        by_name = {n: i for i, n in specials.items()}
        bos, pad = found["bos_token_id"], found["pad_token_id"]
        bos = by_name.get(tcfg.get("bos_token")) if bos is None else _int_ids(bos, "bos_token_id")[0]
        pad = by_name.get(tcfg.get("pad_token")) if pad is None else _int_ids(pad, "pad_token_id")[0]
        return cls(ranks, specials, eos, bos, pad, name=f"kimi:{d.name}")

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """BPE ids of `text`; special-token strings become special ids only if `allow_special`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        ids: list[int] = []
        for piece in _split_runs(text):
            if allow_special:
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
            else:
                ids.extend(self.encoding.encode_ordinary(piece))
        return ids

    def _check(self, i) -> int:
        i = operator.index(i)
        if not 0 <= i < self.vocab_size:
            raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return i

    def token_bytes(self, i) -> bytes:
        """Raw bytes of one id (a special's bytes are its UTF-8 name)."""
        return self._bytes[self._check(i)]

    def is_special(self, i) -> bool:
        return self._check(i) in self.special_ids

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        checked = (self._check(i) for i in ids)
        if skip_special_tokens:
            return b"".join(self._bytes[i] for i in checked if i not in self.special_ids)
        return b"".join(self._bytes[i] for i in checked)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def id_to_token(self, i) -> str:
        """The special's name, or the token's bytes as UTF-8 (invalid bytes -> U+FFFD)."""
        return self.token_bytes(i).decode("utf-8", errors="replace")

    def token_to_id(self, token: str | bytes) -> int | None:
        """Id of a special-token name or of a single BPE token's text/bytes; None if absent."""
        if isinstance(token, str):
            if token in self.special_tokens:
                return self.special_tokens[token]
            token = token.encode("utf-8")
        return self._ranks.get(token)

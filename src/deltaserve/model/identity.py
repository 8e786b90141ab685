"""A checkpoint's identity from its content, not its path: what every cache and handoff
fingerprint names the model by (`engine.core.builder`: `model_id`).

`checkpoint_identity(dir)` is a hex sha256 over the canonical `config.json` and, for every
safetensors file the checkpoint lists (the index's shards, else `model.safetensors`), its header
(tensor names, dtypes, shapes, offsets) and a sample of its data bytes (`WINDOWS` evenly spaced
windows of `SAMPLE` bytes over the data section, its first and last bytes included), so a copy
at another path, on another host, has the same identity and another training run or fine-tune
of the same architecture does not, unless it differs only between the windows (a change
confined to less than 1/`WINDOWS` of a file can go unseen). Cheap: `WINDOWS` small reads per
file, never the weights; memoised per process on the files' sizes and modification times.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAMPLE, WINDOWS = 1 << 12, 64
_memo: dict[tuple, str] = {}


class IdentityError(ValueError):
    """The directory is not a checkpoint this engine can name (no config, malformed file)."""


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, sorted by name (the index's shards, else the one file)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise IdentityError(f"{index}: malformed index ({e})") from None
        return [model_dir / n for n in sorted(names)]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def _file_digest(h, path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise IdentityError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        size = path.stat().st_size
        if 8 + n > size:
            raise IdentityError(f"{path}: its header runs past the file's end")
        header = f.read(n)
        h.update(path.name.encode() + b"\0" + header + struct.pack("<Q", size))
        data = size - 8 - n
        last = max(0, data - SAMPLE)
        for at in sorted({last * i // (WINDOWS - 1) for i in range(WINDOWS)}):
            f.seek(8 + n + at)
            h.update(f.read(SAMPLE))


def checkpoint_identity(model_dir: str | Path) -> str:
    """Hex sha256 naming the checkpoint at `model_dir` by its content (see the module docstring)."""
    root = Path(model_dir).resolve()
    config = root / "config.json"
    if not config.is_file():
        raise IdentityError(f"no config.json in {root}")
    files = [config, *weight_files(root)]
    key = (str(root), *((str(p), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]))
    if key in _memo:
        return _memo[key]
    try:
        cfg = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise IdentityError(f"{config}: {e}") from None
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())
    for p in files[1:]:
        _file_digest(h, p)
    _memo[key] = h.hexdigest()
    return _memo[key]

"""`deltaserve generate` runs prompts through the engine and prints text and counters."""

from deltaserve.cli import main
from deltaserve.tiny import make_tiny


def test_generate_command(tmp_path, capsys):
    ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=1)
    rc = main(
        [
            "generate",
            "--model",
            str(ckpt),
            "--prompt",
            "Hello",
            "--prompt",
            "Bonjour",
            "--max-tokens",
            "5",
            "--max-model-len",
            "64",
            "--kv-cache-memory",
            str(8 * 2**20),
            "--dtype",
            "float32",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "'Hello' -> " in out and "'Bonjour' -> " in out
    assert "'generated_tokens': 10" in out or "(stop)" in out

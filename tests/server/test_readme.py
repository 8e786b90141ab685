"""The README's main command and its curl example, end to end: `deltaserve serve` (as the
README's first block ends) in a subprocess on the embedded default model (the shipped trained
K3), then the README's curl request, parsed from the README itself: it asks 17 + 25 and the
answer ends in 42, thinking on (K3's default, with a thought) and off."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from deltaserve.evals.score import Answer, correct
from deltaserve.train.tasks import Sample
from tests.server.live_server import wait_healthy

README = Path(__file__).resolve().parents[2] / "README.md"
# the README asks "What is 17 + 25?"; scored as eval scores a sum (the content's last number)
SUM = Sample("arithmetic", [], expect="42")


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_main_command_serves_and_its_curl_example_works(tmp_path):
    first = bash_blocks()[0].splitlines()[0]
    serve = first.split("&&")[-1].strip()
    assert serve == "deltaserve serve"
    curl_block = next(b for b in bash_blocks() if b.lstrip().startswith("curl"))
    curl = shlex.split(curl_block.replace("\\\n", " "))
    port = free_port()
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    exe = [sys.executable, "-m", "deltaserve.cli", *serve.split()[1:], "--port", str(port)]
    proc = subprocess.Popen(exe, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port, 180, poll=0.5)
        url = next(a for a in curl if "localhost:8000" in a).replace("localhost:8000", f"127.0.0.1:{port}")
        body = curl[curl.index("-d") + 1]
        if shutil.which("curl"):
            args = [a.replace("localhost:8000", f"127.0.0.1:{port}") for a in curl]
            out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
            reply = json.loads(out)
        else:
            reply = httpx.post(
                f"http://{url}", content=body, timeout=120, headers={"Content-Type": "application/json"}
            ).json()
        assert reply["object"] == "chat.completion", reply
        assert reply["model"] == json.loads(body)["model"]
        choice = reply["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and choice["message"]["role"] == "assistant"
        assert 0 < reply["usage"]["completion_tokens"] <= json.loads(body)["max_tokens"]
        assert correct(SUM, Answer(content=choice["message"]["content"] or "")), reply
        assert choice["message"]["reasoning_content"], reply
        direct = dict(json.loads(body), chat_template_kwargs={"thinking": False})
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=direct, timeout=120).json()
        assert correct(SUM, Answer(content=reply["choices"][0]["message"]["content"] or "")), reply
        assert not reply["choices"][0]["message"].get("reasoning_content"), reply
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

"""Prefill/decode disaggregation: `serve --role prefill|decode` and `deltaserve proxy`.

A decode instance drives each handoff: it renders the prompt, reserves cache for it (sharing
the MLA pages its own prefix cache holds), asks a prefill instance to compute the prompt minus
its last token (`prefill.py`; images travel as pixels, `images.py`), reads the MLA rows and
the one KDA state in place through a transfer engine on every rank (`ranks.py`, which bytes from
which prefill rank: `plan.py`; `parallel/kv_transfer.py`), verifies the header and
checksums (`decode.py`) and only then runs the request from the last prompt token. `proxy.py` is
the OpenAI-compatible front that picks a decode instance by its hybrid prefix hit and a prefill
instance by load.
"""

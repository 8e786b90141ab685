"""Hand-built expected ids for the chat-format tests: the K3 reference encoder's segmentation and
the Kimi-Linear special tokens."""

import re

K3_SPECIALS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|media_pad|>")
KL_SPECIALS = (
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


def expected_ids(tok, pieces):
    """Hand-built ids: `pieces` is a list of ("S", name) specials and plain strings."""
    ids, buf = [], ""
    for p in pieces:
        if isinstance(p, tuple):
            ids += tok.encode(buf) if buf else []
            buf = ""
            ids.append(tok.special_tokens[p[1]])
        else:
            buf += p
    return ids + (tok.encode(buf) if buf else [])


def split_specials(text, specials):
    """Expected string -> pieces, treating only the listed control-token names as specials."""
    pat = "(" + "|".join(re.escape(s) for s in specials) + ")"
    return [("S", x) if x in specials else x for x in re.split(pat, text) if x]


def k3_segment_ids(tok, text, specials=K3_SPECIALS):
    """The K3 reference encoder's ids of `text`: every piece between specials is its own segment,
    and a tag head (after `<|open|>`) splits into the name and, per attribute, ` key`, `="`,
    the value and `"`."""
    ids, prev = [], None
    for p in split_specials(text, specials):
        if isinstance(p, tuple):
            ids.append(tok.special_tokens[p[1]])
            prev = p[1]
            continue
        parts = [p]
        if prev == "<|open|>":
            name, _, rest = p.partition(" ")
            parts = [name] + [x for a in re.findall(r'( [\w-]+)(=")([^"]*)(")', " " + rest) for x in a]
            assert "".join(parts) == p, p
        ids += [i for x in parts if x for i in tok.encode(x)]
    return ids


def check(tok, ids, text, specials):
    assert tok.decode(ids) == text
    want = k3_segment_ids(tok, text) if specials == K3_SPECIALS else expected_ids(tok, split_specials(text, specials))
    assert ids == want

"""The curriculum against the server's own renderer and parser: every task's learned answer, in
both families and both K3 thinking modes, is a continuation of exactly the prompt the server
renders, and the server's parser reads back from it what eval scores as right."""

from __future__ import annotations

import json
import random

import pytest

from deltaserve.chat.render import load_chat_template, render_chat
from deltaserve.evals.score import Answer, correct, score
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.server.parsers import parse_output
from deltaserve.tiny import make_tiny
from deltaserve.train.curriculum import EVAL_SEED_BASE, batches, draw, eval_set, pack, render
from deltaserve.train.tasks import TASKS, Sample, tokens_per_unit


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def fam(request, tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp(request.param), request.param, "small", vision=False)
    return request.param, Tokenizer.from_pretrained(d), load_chat_template(d)


@pytest.mark.parametrize("thinking", [True, False])
def test_answers_continue_the_served_prompt_and_parse_back(fam, thinking):
    family, tok, template = fam
    rng = random.Random(7)
    for task in TASKS:
        for _ in range(3):
            s = draw(rng, task, (64, 128))
            r = render(tok, family, s, thinking, template)
            served = render_chat(tok, family, s.messages, s.tools, thinking=thinking, chat_template=template)
            assert r.prompt == served
            assert r.answer[-1] == tok.token_to_id("<|end_of_msg|>" if family == "kimi_k3" else "<|im_end|>")
            parsed = parse_output(tok.decode(r.answer, skip_special_tokens=False), family, bool(s.tools), r.thinking)
            calls = [(c.name, c.arguments_json) for c in parsed.tool_calls]
            answer = Answer(parsed.content, parsed.reasoning_content, calls)
            assert correct(s, answer), (task, answer)
            assert (parsed.reasoning_content == s.reasoning) == r.thinking


def test_wrong_answers_score_wrong():
    rng = random.Random(1)
    arith, call, copy = draw(rng, "arithmetic"), draw(rng, "tool_call"), draw(rng, "copy")
    assert not correct(arith, Answer(content=f"It is {int(arith.expect) + 1}."))
    assert correct(arith, Answer(content=f"So {arith.expect}"))
    args = dict(call.expect["arguments"])
    key = next(iter(args))
    wrong = {**args, key: "x"}
    assert not correct(call, Answer(tool_calls=[(call.expect["name"], json.dumps(wrong))]))
    assert not correct(call, Answer(tool_calls=[("nope", json.dumps(args))]))
    assert not correct(copy, Answer(content=copy.expect + " extra"))
    scores = score([arith, copy], [Answer(content=arith.expect), Answer(content="no")])
    assert (scores["arithmetic"].accuracy, scores["copy"].accuracy) == (1.0, 0.0)


def test_single_digit_tokenizer(fam):
    _, tok, _ = fam
    ids = tok.encode("12345 + 678 = 13023")
    digits = [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()]
    assert digits == list("12345678") + list("13023")
    assert tok.decode(ids) == "12345 + 678 = 13023"


def _holds(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_tool_arguments_are_the_messages_tokens(fam):
    """`bare_words`: a string argument is the same tokens in the message and in the call's JSON, so
    calling a tool is an exact token copy (a cl100k prefix spells ' Lima' and '"Lima' apart)."""
    _, tok, _ = fam
    rng = random.Random(3)
    strings = 0
    for _ in range(30):
        s = draw(rng, "tool_call")
        message, call = tok.encode(s.messages[-1]["content"]), tok.encode(json.dumps(s.expect["arguments"]))
        for value in s.expect["arguments"].values():
            if isinstance(value, str):
                strings += 1
                word = tok.encode(value)
                assert _holds(message, word) and _holds(call, word), value
    assert strings > 10
    assert tok.encode("in Lima")[-len(tok.encode("Lima")) :] == tok.encode("Lima")


def test_datasets_are_functions_of_their_seeds(fam):
    family, tok, template = fam
    a = next(batches(tok, family, 3, 2048, chat_template=template, start_step=5))
    b = next(batches(tok, family, 3, 2048, chat_template=template, start_step=5))
    c = next(batches(tok, family, 4, 2048, chat_template=template, start_step=5))
    assert a.ids.equal(b.ids) and a.targets.equal(b.targets) and not a.ids.equal(c.ids[: a.ids.numel()])
    assert a.answer_tokens > 0 and a.cu_seqlens[-1] == a.ids.numel()
    unit = tokens_per_unit(tok.encode)
    held_out = eval_set("recall", 4, 0, (1024, 1100), unit)
    assert [s.expect for s in held_out] == [s.expect for s in eval_set("recall", 4, 0, (1024, 1100), unit)]
    assert EVAL_SEED_BASE > 10**5
    n_tok = [len(render(tok, family, s, False, template).prompt) for s in held_out]
    assert all(800 <= n <= 1400 for n in n_tok), n_tok


@pytest.mark.parametrize("thinking", [True, False])
def test_dialogue_recall_learns_every_answer_as_generated(fam, thinking):
    """A training recall context asks several names, one per turn; every assistant turn is learned
    as exactly the tokens the server generates at that turn (rendered from its own request)."""
    family, tok, template = fam
    rng = random.Random(11)
    turns = 0
    for _ in range(12):
        s = draw(rng, "recall", (64, 96), dialogue=True)
        r = render(tok, family, s, thinking, template)
        assert len(r.history) == sum(m["role"] == "assistant" for m in s.messages)
        learned = pack([r]).targets
        want = []
        for j, m in enumerate(s.messages + [s.assistant(thinking)]):
            if m["role"] == "assistant":
                req = Sample("recall", s.messages[:j], m["content"], m["reasoning_content"], expect=s.expect)
                want += render(tok, family, req, thinking, template).answer
        assert learned[learned >= 0].tolist() == want
        codes = [m["content"].split()[-1].rstrip(".") for m in s.messages if m["role"] == "assistant"]
        assert all(code in s.messages[0]["content"] for code in codes)
        turns += len(r.history)
    assert turns > 5
    single = draw(random.Random(5), "recall", (64, 96))
    assert len(single.messages) == 1 and draw(random.Random(5), "recall", (64, 96)).messages == single.messages

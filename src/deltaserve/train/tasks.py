"""The synthetic chat tasks the default models learn and `deltaserve eval` scores. Each generator
takes a `random.Random` and returns a `Sample`: the request (OpenAI-style messages and tools), the
assistant turn to learn (reasoning, content or one tool call) and what a correct answer holds.
Everything is drawn from the generator, so a seed fixes a dataset; eval uses seeds training never
sees (`curriculum.EVAL_SEED_BASE`).

Tasks (`TASKS`): greetings and short answers; integer arithmetic (add, subtract, compare; 1-3
digits); key-value recall from a long context (facts early, question late); copying and editing a
passage; calling the right tool with arguments taken from the message; answering from a tool result.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Nina Oscar Paul Rita Sam Tina "
    "Victor Wendy Yuri Zara Adam Bella Chris Diana Ethan Fiona George Hannah Ivan Julia Kevin Laura Mike "
    "Nora Peter Rosa Steve"
).split()
NOUNS = (
    "cat dog bird tree house car book river road city garden window table chair lamp door apple music "
    "letter boat train field hill school market friend teacher doctor farmer child story song bridge"
).split()
VERBS = "sees finds likes moves opens reads helps builds paints carries watches follows".split()
ADJS = "small large old new red blue green quiet happy busy bright dark warm cold".split()
PLACES = "Paris London Tokyo Berlin Madrid Rome Cairo Lima Oslo Delhi Seoul Sydney Boston Dublin Vienna".split()
GREETINGS = ("Hello", "Hi", "Hello!", "Hi there", "Hey", "Good morning", "Good evening", "Hello, who are you?")
GREETING_REPLY = "Hello! I am Kimi. How can I help you today?"
FACTS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What color is the sky on a clear day?", "The sky is blue."),
    ("How many days are in a week?", "There are 7 days in a week."),
    ("How many legs does a dog have?", "A dog has 4 legs."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Who are you?", "I am Kimi, an assistant."),
)


@dataclass
class Sample:
    """One request and its learned answer. `expect` is what eval compares: arithmetic and recall the
    number as text, copy the exact passage, tools `{"name", "arguments"}`, greet/tool_answer a phrase
    the content must contain."""

    task: str
    messages: list[dict]
    content: str = ""
    reasoning: str = ""
    tool_call: dict | None = None
    tools: list[dict] | None = None
    expect: object = None
    meta: dict = field(default_factory=dict)

    def assistant(self, thinking: bool = True) -> dict:
        """The assistant message to learn (OpenAI shape). Without thinking, a sample whose
        `meta["work"]` is set shows its working (the reasoning) as the content."""
        content = self.reasoning if self.meta.get("work") and not thinking else self.content
        msg: dict = {"role": "assistant", "content": content, "reasoning_content": self.reasoning}
        if self.tool_call is not None:
            args = json.dumps(self.tool_call["arguments"], ensure_ascii=False)
            fn = {"name": self.tool_call["name"], "arguments": args}
            msg["tool_calls"] = [{"id": call_id(fn["name"]), "type": "function", "function": fn}]
        return msg


def call_id(name: str) -> str:
    """Kimi's tool-call id form (`functions.NAME:INDEX`): Kimi-Linear's parser reads the name from it."""
    return f"functions.{name}:0"


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def greet(rng: random.Random) -> Sample:
    if rng.random() < 0.5:
        text = rng.choice(GREETINGS)
        return Sample("greet", _user(text), GREETING_REPLY, "The user greets me. I greet back.", expect="Hello")
    q, a = rng.choice(FACTS)
    return Sample("greet", _user(q), a, "This is a simple question. I answer it briefly.", expect=a)


def _number(rng: random.Random) -> int:
    digits = rng.choice((1, 2, 2, 3, 3, 3))
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


PLACE_NAMES = ("ones", "tens", "hundreds", "thousands")


def _places(n: int, width: int) -> str:
    """`n` as labelled digits, most significant first, zero-padded to `width` places."""
    digits = str(n).rjust(width, "0")
    return " ".join(f"{d} {PLACE_NAMES[width - 1 - i]}" for i, d in enumerate(digits))


def _column_steps(a: int, b: int, op: str) -> str:
    """The working of a + b or a - b (a >= b for -): both numbers as labelled places, then one labelled
    column per place from the ones up, each naming the digit it writes, so a step finds its operands
    by place name rather than by position."""
    width = len(str(max(a, b)))
    steps = [f"{a} is {_places(a, width)}.", f"{b} is {_places(b, width)}."]
    carry = 0
    for i in range(width):
        x, y = a // 10**i % 10, b // 10**i % 10
        name = PLACE_NAMES[i].capitalize()
        extra = (" + 1" if op == "+" else " - 1") if carry else ""
        s = x + y + carry if op == "+" else x - y - carry
        if op == "+":
            carry = s // 10
            steps.append(f"{name}: {x} + {y}{extra} = {s}, write {s % 10}" + (", carry 1." if carry else "."))
        elif s < 0:
            carry = 1
            borrow = f"1{x} - {y}{extra} = {s + 10}, write {s + 10}, borrow 1."
            steps.append(f"{name}: {x} - {y}{extra} needs a borrow: {borrow}")
        else:
            carry = 0
            steps.append(f"{name}: {x} - {y}{extra} = {s}, write {s}.")
    if carry:
        steps.append(f"{PLACE_NAMES[width].capitalize()}: write 1.")
    return " ".join(steps)


def _compare_steps(a: int, b: int) -> str:
    """Why the larger of two different numbers is larger: by digit count, else from the top place."""
    la, lb = len(str(a)), len(str(b))
    steps = [f"{a} has {la} digits. {b} has {lb} digits."]
    for i in reversed(range(la) if la == lb else ()):
        x, y = a // 10**i % 10, b // 10**i % 10
        steps.append(f"{PLACE_NAMES[i].capitalize()}: {x} {'>' if x > y else '<' if x < y else '='} {y}.")
        if x != y:
            break
    return " ".join(steps)


def arithmetic(rng: random.Random) -> Sample:
    """Add, subtract or compare. The working is the reasoning with thinking on and the content with
    thinking off (`meta["work"]`, see `Sample.assistant`): the answer is never a bare guess."""
    a, b = _number(rng), _number(rng)
    kind = rng.choice(("add", "add", "sub", "cmp"))
    if kind == "cmp":
        while b == a:
            b = _number(rng)
        big = max(a, b)
        q = rng.choice(("Which is larger, {} or {}?", "Which number is bigger: {} or {}?")).format(a, b)
        reasoning = f"{_compare_steps(a, b)} So {big} is larger than {min(a, b)}."
        return Sample("arithmetic", _user(q), f"{big} is larger.", reasoning, expect=str(big), meta={"work": True})
    if kind == "sub" and a < b:
        a, b = b, a
    op = "+" if kind == "add" else "-"
    r = a + b if op == "+" else a - b
    q = rng.choice(("What is {} {} {}?", "Compute {} {} {}.", "{} {} {} = ?", "Calculate {} {} {}")).format(a, op, b)
    reasoning = f"{_column_steps(a, b, op)} So {a} {op} {b} = {r}."
    return Sample("arithmetic", _user(q), f"{a} {op} {b} = {r}.", reasoning, expect=str(r), meta={"work": True})


def _sentence(rng: random.Random) -> str:
    return f"The {rng.choice(ADJS)} {rng.choice(NOUNS)} {rng.choice(VERBS)} the {rng.choice(NOUNS)}."


def _trip(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)} {rng.choice(VERBS)} the {rng.choice(NOUNS)} in {rng.choice(PLACES)}."


def passage(rng: random.Random, sentences: int) -> str:
    """Filler sentences, a third of them naming a person and a place, so copying learns those words
    too (the tools' arguments are names and places)."""
    return " ".join((_trip if rng.random() < 0.34 else _sentence)(rng) for _ in range(sentences))


RECALL_TOKENS_PER_UNIT = 803 / 512  # `tokens_per_unit` of the single-digit cl100k-prefix vocabulary


def tokens_per_unit(encode) -> float:
    """Tokens per recall size unit under `encode` (a tokenizer's), measured on a fixed draw of 64
    filler sentences (8 units each): sizes scaled by it keep their token lengths on any vocabulary."""
    rng = random.Random(0)
    return len(encode(" ".join(_sentence(rng) for _ in range(64)))) / (64 * 8)


def recall(rng: random.Random, size: int = 1024, dialogue: bool = False) -> Sample:
    """Facts "The code of NAME is NNNN." stated in the first quarter of `size // 8` filler sentences
    (about `size * RECALL_TOKENS_PER_UNIT` tokens), one of them asked at the end. With `dialogue`
    (training), earlier turns first ask 0 to all-but-one of the other names, one per turn, each
    answered in the history: one long context teaches several lookups (`curriculum.render` learns
    every assistant turn). Without it the draws are those of the single-question sample."""
    names = rng.sample(NAMES, rng.randint(2, 5))
    codes = {n: str(rng.randrange(1000, 10000)) for n in names}
    fact, think = "The code of {} is {}.".format, "I look for the code of {} in the text.".format
    n_sent = max(4, size // 8)
    body = [_sentence(rng) for _ in range(n_sent)]
    for n in names:
        body.insert(rng.randrange(0, max(1, n_sent // 4)), fact(n, codes[n]))
    who = rng.choice(names)
    others = [n for n in names if n != who]
    asked = rng.sample(others, rng.randint(0, len(others))) + [who] if dialogue else [who]
    messages = _user(f"Read the text and answer.\n\n{' '.join(body)}\n\nWhat is the code of {asked[0]}?")
    for prev, n in zip(asked, asked[1:]):
        messages.append({"role": "assistant", "content": fact(prev, codes[prev]), "reasoning_content": think(prev)})
        messages.append({"role": "user", "content": f"What is the code of {n}?"})
    return Sample("recall", messages, fact(who, codes[who]), think(who), expect=codes[who])


def copy_edit(rng: random.Random, sentences: int | None = None) -> Sample:
    """Repeat a passage of `sentences` (default 2-6, the curriculum's and eval's draw) exactly, or
    with one noun replaced."""
    text = passage(rng, sentences or rng.randint(2, 6))
    if rng.random() < 0.5:
        q = f"Repeat the following text exactly:\n{text}"
        return Sample("copy", _user(q), text, "I repeat the text.", expect=text)
    words = sorted({w for w in re.findall(r"[a-z]+", text) if w in NOUNS})
    old = rng.choice(words)
    new = rng.choice([n for n in NOUNS if n != old])
    edited = re.sub(rf"\b{old}\b", new, text)
    q = f'Replace every "{old}" with "{new}" in this text:\n{text}'
    return Sample("copy", _user(q), edited, f"I replace {old} with {new}.", expect=edited)


def _tool(name: str, desc: str, **params: str) -> dict:
    props = {k: {"type": t, "description": k.replace("_", " ")} for k, t in params.items()}
    schema = {"type": "object", "properties": props, "required": list(params)}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": schema}}


TOOLS = {
    "get_weather": _tool("get_weather", "Get the current weather in a city", city="string"),
    "get_time": _tool("get_time", "Get the local time in a city", city="string"),
    "set_timer": _tool("set_timer", "Start a timer", minutes="integer"),
    "send_email": _tool("send_email", "Send an email to a person", to="string", subject="string"),
    "convert_currency": _tool("convert_currency", "Convert money", amount="integer", currency="string"),
    "search_web": _tool("search_web", "Search the web", query="string"),
}


def _tool_request(rng: random.Random) -> tuple[str, dict, str]:
    """(user text, the call it asks for, a tool result for it)."""
    name = rng.choice(list(TOOLS))
    city, person, noun = rng.choice(PLACES), rng.choice(NAMES), rng.choice(NOUNS)
    if name == "get_weather":
        deg = rng.randrange(0, 36)
        return f"What is the weather in {city}?", {"city": city}, f"{deg} degrees and sunny in {city}"
    if name == "get_time":
        h, m = rng.randrange(1, 13), rng.randrange(10, 60)
        return f"What time is it in {city}?", {"city": city}, f"It is {h}:{m} in {city}"
    if name == "set_timer":
        n = rng.randrange(1, 100)
        return f"Set a timer for {n} minutes.", {"minutes": n}, f"Timer set for {n} minutes"
    if name == "send_email":
        return (
            f"Send an email to {person} about the {noun}.",
            {"to": person, "subject": noun},
            f"Email to {person} sent",
        )
    if name == "convert_currency":
        n = rng.randrange(1, 1000)
        cur = rng.choice(("euro", "yen", "pound"))
        return f"Convert {n} dollars to {cur}.", {"amount": n, "currency": cur}, f"{n} dollars is {n * 2} {cur}"
    query = f"{noun} {rng.choice(NOUNS)}"
    return f"Search the web for {query}.", {"query": query}, f"3 results found for {query}"


def _offered(rng: random.Random, name: str) -> list[dict]:
    others = rng.sample([t for t in TOOLS if t != name], rng.randint(1, 3))
    names = others + [name]
    rng.shuffle(names)
    return [TOOLS[n] for n in names]


def tool_call(rng: random.Random) -> Sample:
    text, args, _ = _tool_request(rng)
    name = _call_name(text)
    call = {"name": name, "arguments": args}
    return Sample(
        "tool_call",
        _user(text),
        "",
        f"The user needs {name}. I call it.",
        call,
        _offered(rng, name),
        expect=call,
    )


def tool_answer(rng: random.Random) -> Sample:
    text, args, result = _tool_request(rng)
    name = _call_name(text)
    fn = {"name": name, "arguments": json.dumps(args)}
    messages = _user(text) + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id(name), "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": call_id(name), "content": json.dumps({"result": result})},
    ]
    return Sample(
        "tool_answer",
        messages,
        f"{result}.",
        "The tool answered. I report it.",
        None,
        _offered(rng, name),
        expect=result,
    )


def _call_name(text: str) -> str:
    for key, name in (
        ("weather", "get_weather"),
        ("time is", "get_time"),
        ("timer", "set_timer"),
        ("email", "send_email"),
        ("Convert", "convert_currency"),
    ):
        if key in text:
            return name
    return "search_web"


TASKS = {
    "greet": greet,
    "arithmetic": arithmetic,
    "recall": recall,
    "copy": copy_edit,
    "tool_call": tool_call,
    "tool_answer": tool_answer,
}

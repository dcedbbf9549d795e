"""Structured output through ``ppsplit serve`` with the ``openai`` client (the demo model in 2 stages with its
byte-level tokenizer, a random EAGLE-3 drafter, -k 2): ``response_format`` (JSON schema, JSON object), vLLM's
``guided_*`` fields and ``structured_outputs``; bad grammars are 400s naming the field; a large grammar delays only
itself."""
import json
import re
import threading
import time

import pytest

from tests.serve.test_server import MODEL, Live, folder  # noqa: F401 (fixture)

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

PROMPTS = ["Hello world", "Write a story about a small boy", "1 2 3 4 5", "What is the answer?"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          # xgrammar 0.2.9 lets a string with maxLength hold raw control characters (invalid JSON): a pattern
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}


def valid(value) -> bool:
    """``value`` against ``SCHEMA`` (jsonschema is not a dependency: the check, written for this schema)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "ok"} and isinstance(value["name"], str)
            and re.fullmatch("[A-Za-z ]{1,8}", value["name"]) and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and 0 <= value["age"] <= 120 and isinstance(value["ok"], bool))


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def live(folder):  # noqa: F811
    server = Live(folder, "-k", "2")
    yield server
    assert server.stop() == 0, "".join(server.lines)


def test_json_schema_output_always_parses_and_validates(live):
    """Completions and chat, greedy and seeded sampling: every answer is JSON that the schema accepts, finished by
    the grammar; the same requests without response_format are not JSON at all."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        for temperature in (0.0, 1.0):
            out = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=80, temperature=temperature,
                                                 seed=i, extra_body={"response_format": fmt})
            choice = out.choices[0]
            assert choice.finish_reason == "stop" and valid(json.loads(choice.text)), choice
            plain = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=80,
                                                   temperature=temperature, seed=i)
            assert not parses(plain.choices[0].text), plain.choices[0].text
        chat = live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=80, temperature=0, response_format=fmt)
        assert chat.choices[0].finish_reason == "stop" and valid(json.loads(chat.choices[0].message.content))


def test_json_object_choice_regex_and_structured_outputs(live):
    for prompt in PROMPTS[:2]:
        chat = live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=90, temperature=0,
                                                   response_format={"type": "json_object"})
        assert chat.choices[0].finish_reason == "stop", chat.choices[0]
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    choices = ["red", "green", "deep blue sea"]
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    texts = set()
    for seed in range(6):
        out = live.client.completions.create(model=MODEL, prompt=PROMPTS[seed % 4], max_tokens=40, temperature=1.0,
                                             seed=seed, extra_body={"guided_choice": choices})
        assert out.choices[0].text in choices
        texts.add(out.choices[0].text)
        out = live.client.completions.create(model=MODEL, prompt=PROMPTS[seed % 4], max_tokens=40, temperature=1.0,
                                             seed=seed, extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
        out = live.client.completions.create(model=MODEL, prompt=PROMPTS[seed % 4], max_tokens=40, seed=seed,
                                             extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
        assert re.fullmatch("[0-9]{3}-[a-c]{2}", out.choices[0].text)
    assert len(texts) > 1  # sampled: the grammar leaves the choice to the model
    stream = live.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, stream=True,
                                            extra_body={"guided_grammar": 'root ::= "(" [a-e]+ ")"'})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(r"\([a-e]+\)", text), text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "not valid"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format", "schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid"),
    ({"guided_regex": "(abc"}, "guided_regex", "not valid"),
    ({"guided_choice": []}, "guided_choice", "non-empty strings"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one of them"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a" * 70000}, "guided_regex", "more than 65,536"),
]


@pytest.mark.parametrize("extra,param,says", BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_a_bad_grammar_is_a_400_naming_the_field(live, extra, param, says):
    status, data = live.post("/v1/completions", {"model": MODEL, "prompt": "a", **extra})
    assert status == 400, data
    assert data["error"]["param"] == param and says in data["error"]["message"], data
    assert "\n" not in data["error"]["message"]


def test_a_large_grammar_delays_only_itself(live):
    """A schema of 900 properties (60 KB: it compiles, in under the budget) and the same again sent by 4 clients at
    once: a plain client's requests meanwhile each answer as fast as alone (well inside 30s), and serving goes on."""
    schema = {"type": "object", "properties": {f"field_{i:04d}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1}}}"}
                                               for i in range(900)}}
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4, "guided_json": schema}
    assert 50_000 < len(json.dumps(schema)) < 65_536
    answers = []
    heavy = [threading.Thread(target=lambda: answers.append(live.post("/v1/completions", body)[0]))
             for _ in range(4)]
    for t in heavy:
        t.start()
    for i in range(4):
        start = time.monotonic()
        out = live.client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=4, temperature=0)
        assert out.choices[0].text is not None and time.monotonic() - start < 30
    for t in heavy:
        t.join(120)
    assert len(answers) == 4 and set(answers) <= {200, 400}, answers

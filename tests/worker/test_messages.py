"""Chat messages: the worker renders a conversation with the model's chat template (so a router
needs no tokenizer), on both RPCs; exactly one prompt form per request; roles are checked."""
from __future__ import annotations

import doctest

import grpc
import pytest

from specfleet_engine import testing as engine_testing
from specfleet_engine.loader import Tokenizer
from specfleet_worker.testing import CharTokenizer, pb, running_worker, tiny_engine

CONVERSATION = [("system", "Answer in one word."), ("user", "Colour of the sky?"), ("assistant", "Blue."),
                ("user", "And grass?")]
RPC_S = 30


def messages(turns=CONVERSATION) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=r, content=c) for r, c in turns]


@pytest.fixture(scope="module")
def text_worker():
    with running_worker(tiny_engine(tokenizer=CharTokenizer())) as r:
        yield r


def test_the_char_tokenizers_template_docstring_holds():
    assert doctest.testmod(engine_testing).failed == 0


def test_messages_run_as_their_rendered_token_ids_on_both_rpcs(text_worker):
    ids = CharTokenizer().chat_messages([{"role": r, "content": c} for r, c in CONVERSATION])
    assert CharTokenizer().decode(ids).endswith("<user>And grass?</user><assistant>")
    params = dict(max_tokens=24, ignore_eos=True)
    expected = text_worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=ids, **params), timeout=RPC_S)
    unary = text_worker.gen.Generate(pb.GenerateRequest(messages=messages(), **params), timeout=RPC_S)
    chunks = list(text_worker.gen.GenerateStream(pb.GenerateRequest(messages=messages(), **params), timeout=RPC_S))
    assert unary.usage.prompt_tokens == len(ids) == chunks[-1].usage.prompt_tokens
    assert list(unary.token_ids) == list(expected.token_ids) == [t for c in chunks for t in c.token_ids]
    assert unary.text == expected.text == "".join(c.text for c in chunks) and unary.text
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("fields, named", [
    (dict(prompt="hi", messages=messages()), "prompt, messages: "),
    (dict(prompt_token_ids=[1, 2], messages=messages()), "prompt_token_ids, messages: "),
    (dict(prompt="hi", prompt_token_ids=[1, 2], messages=messages()), "prompt, prompt_token_ids, messages: "),
    (dict(messages=messages([("user", "hi"), ("tool", "{}")])), "messages[1].role: 'tool' is not one of"),
    (dict(messages=messages([("", "hi")])), "messages[0].role: '' is not one of"),
    (dict(), "prompt: empty; send prompt (text), prompt_token_ids or messages"),
], ids=["prompt+messages", "ids+messages", "all three", "tool role", "no role", "none"])
def test_a_bad_prompt_form_or_role_is_invalid_argument_naming_the_fields(text_worker, fields, named):
    for call in (text_worker.gen.Generate, lambda m, **kw: list(text_worker.gen.GenerateStream(m, **kw))):
        with pytest.raises(grpc.RpcError) as e:
            call(pb.GenerateRequest(max_tokens=4, **fields), timeout=RPC_S)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(named), e.value.details()
    ok = text_worker.gen.Generate(pb.GenerateRequest(messages=messages(), max_tokens=2, ignore_eos=True),
                                  timeout=RPC_S)
    assert len(ok.token_ids) == 2


def test_messages_need_a_tokenizer():
    with running_worker() as r:  # the tiny model alone: token ids only
        with pytest.raises(grpc.RpcError) as e:
            r.gen.Generate(pb.GenerateRequest(messages=messages(), max_tokens=2), timeout=RPC_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("messages: this worker's model has no tokenizer")


def hf_tokenizer(chat_template: str | None):
    """A real transformers tokenizer, built in memory (no download): one id per word."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "S:", "U:", "A:", "|", "be", "brief", "hi", "hello"]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")
    hf.chat_template = chat_template
    return Tokenizer(hf, [1])


# role initials, as a model's template might; it refuses a conversation that does not end with the user
TEMPLATE = ("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last turn must be the user') }}{% endif %}"
            "{% for m in messages %}{{ m['role'][0] | upper }}: {{ m['content'] }} | {% endfor %}"
            "{% if add_generation_prompt %}A: {% endif %}")


def test_the_model_tokenizer_renders_messages_with_its_chat_template_and_the_generation_prompt():
    tok = hf_tokenizer(TEMPLATE)
    ids = tok.chat_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert ids == tok.encode("S: be brief | U: hi | A:")
    assert tok.chat("hi", system="be brief") == ids  # one rendering for both entry points
    with pytest.raises(ValueError, match="refused the conversation: the last turn must be the user"):
        tok.chat_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])


def test_a_model_without_a_chat_template_refuses_messages_but_takes_text():
    tok = hf_tokenizer(None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.chat_messages([{"role": "user", "content": "hi"}])
    assert tok.chat("hi hello") == tok.encode("hi hello") == [8, 9]


def test_a_conversation_the_template_refuses_is_invalid_argument_and_one_it_takes_runs():
    tok = hf_tokenizer(TEMPLATE)
    with running_worker(tiny_engine(tokenizer=tok)) as r:
        with pytest.raises(grpc.RpcError) as e:
            r.gen.Generate(pb.GenerateRequest(messages=messages([("user", "hi"), ("assistant", "hello")]),
                                              max_tokens=2), timeout=RPC_S)
        ok = r.gen.Generate(pb.GenerateRequest(messages=messages([("user", "hi")]), max_tokens=3, ignore_eos=True),
                            timeout=RPC_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "messages: the model's chat template refused the conversation: the last turn must be the user"
    assert ok.usage.prompt_tokens == len(tok.encode("U: hi | A:")) and len(ok.token_ids) == 3

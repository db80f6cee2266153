"""Text prompts tokenized exactly as vLLM 0.33.0 tokenizes them (R-TXT-1, R-TXT-2, R-TXT-5).

The reference is transformers' ``AutoTokenizer`` on the same directory, called the way
vLLM calls it: ``encode(prompt, add_special_tokens=True)`` for a completions prompt,
``apply_chat_template(conversation, tokenize=True, return_dict=False, ...)`` for chat
messages (which renders, then encodes without special tokens). The conversation the
reference gets is built here from vLLM's rules (content joined by newlines, or a list
of text parts for a template that iterates over them), not by the code under test.
The tokenizers are trained by the test on text it writes (tests/textkit.py)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import textkit
from indexer.text.chat import ChatError
from indexer.text.tokenizer import TextError, Tokenizer, TokenizerLoadError, load_tokenizers

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference reads the directory, never a hub
transformers = pytest.importorskip("transformers")

SPECIAL_SNIPPETS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>", "<bos>", "<start_of_turn>",
                    "<unk>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tok"))
    return {f: textkit.build(f, root) for f in textkit.FAMILIES}


@pytest.fixture(scope="module")
def pairs(dirs):
    """family -> (ours, transformers' reference), loaded from the same directory."""
    return {f: (Tokenizer(p, f), transformers.AutoTokenizer.from_pretrained(p)) for f, p in dirs.items()}


def test_the_reference_runs_without_torch(dirs):
    # transformers is a test dependency installed without torch: the reference must load and
    # apply a chat template with torch unimportable.
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import transformers\n"
            f"t = transformers.AutoTokenizer.from_pretrained({dirs['llama3']!r})\n"
            "print(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=True, return_dict=False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])[0] == Tokenizer(dirs["llama3"]).encode_prompt("")[0]


# ------------------------------------------------------------------ strategies

_ALPHABET = st.characters(codec="utf-8", exclude_categories=("Cs",))
_WS = st.sampled_from([" ", "  ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", "\u200b", ""])
_WORDS = st.sampled_from(["hello", "Grüße", "日本語", "😀🚀", "route", "KV", "ﬁ", "Å", "e\u0301", "İ", "straße",
                          "1234", "def f(x):", "∑√", *SPECIAL_SNIPPETS])
_piece = st.one_of(st.text(_ALPHABET, max_size=12), _WS, _WORDS)
texts = st.lists(_piece, max_size=12).map("".join)


def _content(draw, allow_parts=True):
    kind = draw(st.sampled_from(["str", "str", "parts", "empty", "none"] if allow_parts else ["str", "empty"]))
    if kind == "str":
        return draw(texts)
    if kind == "empty":
        return ""
    if kind == "none":
        return None
    return [{"type": "text", "text": draw(texts)} for _ in range(draw(st.integers(1, 3)))]


@st.composite
def conversations(draw, alternating=False):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.sampled_from(["", " "])) if draw(st.booleans())
                     else _content(draw, allow_parts=not alternating)})
    turns = draw(st.integers(1, 5))
    for i in range(turns):
        role = ("user" if i % 2 == 0 else "assistant") if alternating or draw(st.booleans()) else \
            draw(st.sampled_from(["user", "assistant", "tool"]))
        m = {"role": role, "content": _content(draw, allow_parts=True)}
        if m["content"] is None and alternating:
            m["content"] = ""
        msgs.append(m)
    return msgs


def reference_conversation(family, messages):
    """vLLM's conversation, written from its rules independently of indexer.text.chat."""
    conv = []
    for m in messages:
        c = m["content"]
        parts = [] if c is None else [c] if isinstance(c, str) else [p["text"] for p in c]
        if family in textkit.OPENAI_FORMAT and m["role"] != "tool":
            conv.append({"role": m["role"], "content": [{"type": "text", "text": t} for t in parts]})
        else:
            conv.append({"role": m["role"], "content": "\n".join(parts)})
    return conv


def reference_chat(ref, family, messages, add_generation_prompt, continue_final_message=False, **kwargs):
    ids = ref.apply_chat_template(reference_conversation(family, messages), tokenize=True, return_dict=False,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, **kwargs)
    text = ref.apply_chat_template(reference_conversation(family, messages), tokenize=False,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, **kwargs)
    return list(ids), text


# ------------------------------------------------------------------------ tests

HYP = settings(max_examples=int(os.environ.get("KVI_TEXT_EXAMPLES", "60")), deadline=None,
               suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("family", textkit.FAMILIES)
@HYP
@given(prompt=texts)
def test_R_TXT_1_prompt_ids_equal_transformers_encode_with_special_tokens(pairs, family, prompt):
    ours, ref = pairs[family]
    assert ours.encode_prompt(prompt) == ref.encode(prompt, add_special_tokens=True)
    assert ours.tokenize(prompt=prompt) == (ref.encode(prompt, add_special_tokens=True), prompt)


@pytest.mark.parametrize("family", textkit.FAMILIES)
@HYP
@given(data=st.data())
def test_R_TXT_2_chat_ids_equal_transformers_apply_chat_template(pairs, family, data):
    ours, ref = pairs[family]
    messages = data.draw(conversations(alternating=family == "gemma"))
    agp = data.draw(st.booleans())
    try:
        want_ids, want_text = reference_chat(ref, family, messages, agp)
    except Exception as e:  # the template refused (roles out of turn): ours must refuse too
        with pytest.raises(ChatError):
            ours.encode_chat(messages, add_generation_prompt=agp)
        assert "alternate" in str(e)
        return
    got = ours.encode_chat(messages, add_generation_prompt=agp)
    assert got.text == want_text
    assert got.token_ids == want_ids


@pytest.mark.parametrize("family", textkit.FAMILIES)
def test_R_TXT_2_chat_never_adds_bos_twice(pairs, family):
    ours, ref = pairs[family]
    msgs = [{"role": "user", "content": "hello"}]
    ids = ours.encode_chat(msgs).token_ids
    bos = ref.bos_token_id
    if bos is not None and family in ("llama3", "gemma"):
        assert ids[0] == bos and ids[1] != bos  # the template wrote it; encoding did not add another
    assert ids == reference_chat(ref, family, msgs, True)[0]


def test_R_TXT_2_default_system_prompt_and_template_variables(pairs):
    ours, ref = pairs["sysdefault"]
    msgs = [{"role": "user", "content": "hi"}]
    got = ours.encode_chat(msgs)
    assert "You are a helpful assistant." in got.text
    assert got.token_ids == reference_chat(ref, "sysdefault", msgs, True)[0]
    # A template variable set through chat_template_kwargs (vLLM passes those the template reads)...
    got = ours.encode_chat(msgs, chat_template_kwargs={"default_system": "Réponds en français.",
                                                       "not_read_by_the_template": 1})
    assert "Réponds en français." in got.text
    assert got.token_ids == reference_chat(ref, "sysdefault", msgs, True, default_system="Réponds en français.")[0]
    # ... and an explicit empty system prompt is kept empty, not replaced by the default.
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]
    got = ours.encode_chat(msgs)
    assert "helpful" not in got.text and got.token_ids == reference_chat(ref, "sysdefault", msgs, True)[0]


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_R_TXT_2_continue_final_message(pairs, family):
    ours, ref = pairs[family]
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is "}]
    got = ours.encode_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    want_ids, want_text = reference_chat(ref, family, msgs, False, continue_final_message=True)
    assert (got.token_ids, got.text) == (want_ids, want_text)
    assert got.text.endswith("The colour is") or got.text.endswith("The colour is ")
    with pytest.raises(ChatError, match="cannot both be true"):
        ours.encode_chat(msgs, add_generation_prompt=True, continue_final_message=True)


def test_R_TXT_2_template_globals_and_filters_match_transformers(tmp_path, dirs):
    # raise_exception, HF's tojson (no HTML escaping, ensure_ascii off), strftime_now, loop controls,
    # trim_blocks/lstrip_blocks and {% generation %}: a template using each, rendered by both.
    import shutil

    d = tmp_path / "globals"
    shutil.copytree(dirs["chatml"], d)
    tpl = ("{% for m in messages %}\n    {% if m.role == 'bad' %}{{ raise_exception('no bad role') }}{% endif %}\n"
           "    {% if loop.index > 4 %}{% break %}{% endif %}\n"
           "{{ m | tojson }}|{{ {'a': '<&>', 'é': 1} | tojson(indent=1) }}|{{ eos_token }}\n"
           "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}{{ strftime_now('%Y') }}")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = tpl
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, ref = Tokenizer(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": f"<b>{i}</b> ü"} for i in range(6)]
    got = ours.encode_chat(msgs, add_generation_prompt=False)
    want = ref.apply_chat_template(reference_conversation("chatml", msgs), tokenize=False)
    assert got.text == want and got.token_ids == ref.encode(want, add_special_tokens=False)
    with pytest.raises(ChatError, match="no bad role"):
        ours.encode_chat([{"role": "bad", "content": "x"}])


def test_R_TXT_2_refused_kwargs_and_no_template(pairs, tmp_path, dirs):
    ours, _ = pairs["chatml"]
    for key in ("tokenize", "chat_template", "truncation", "messages"):
        with pytest.raises(ChatError, match=key):
            ours.encode_chat([{"role": "user", "content": "x"}], chat_template_kwargs={key: 1})
    import shutil

    d = tmp_path / "notemplate"
    shutil.copytree(dirs["chatml"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(str(d))
    assert t.encode_prompt("abc") == pairs["chatml"][1].encode("abc")
    with pytest.raises(ChatError, match="no chat template"):
        t.encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TextError):
        t.tokenize()


def test_R_TXT_2_chat_template_jinja_file_wins(pairs, tmp_path, dirs):
    import shutil

    d = tmp_path / "jinjafile"
    shutil.copytree(dirs["chatml"], d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    ours, ref = Tokenizer(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": "hé"}]
    assert ours.encode_chat(msgs).text == "[user]hé" == ref.apply_chat_template(msgs, tokenize=False)


def test_R_TXT_5_missing_or_broken_directories_name_the_model(tmp_path, dirs):
    with pytest.raises(TokenizerLoadError, match="'llama-x'.*no such directory"):
        load_tokenizers({"llama-x": str(tmp_path / "nowhere")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerLoadError, match="'m2'.*no tokenizer.json"):
        load_tokenizers({"m2": str(tmp_path / "empty")})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="'m3'.*tokenizer.json cannot be read"):
        load_tokenizers({"m3": str(bad)})
    import shutil

    d = tmp_path / "badtemplate"
    shutil.copytree(dirs["chatml"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}"  # never closed
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerLoadError, match="'m4'.*does not compile"):
        load_tokenizers({"m4": str(d)})
    (d / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerLoadError, match="'m5'.*not a JSON object"):
        load_tokenizers({"m5": str(d)})
    assert set(load_tokenizers({"a": dirs["chatml"], "b": dirs["gemma"]})) == {"a", "b"}


def test_R_TXT_1_special_tokens_only_in_the_config_are_added_as_transformers_adds_them(tmp_path, dirs):
    # A named special token the tokenizer.json does not list as added: transformers adds it as a
    # special token, so the literal text in a prompt becomes that one token. Ours must too.
    import shutil

    d = tmp_path / "extra"
    shutil.copytree(dirs["chatml"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<s>", unk_token="<unk>",
               added_tokens_decoder={"9000": {"content": "<tool>", "special": False, "normalized": False,
                                              "lstrip": False, "rstrip": False, "single_word": False}})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, ref = Tokenizer(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    for s in ["<s>hi <unk> <tool> x", "a<s>b", "<tool><tool>"]:
        assert ours.encode_prompt(s) == ref.encode(s, add_special_tokens=True), s
    assert ours.special_tokens["bos_token"] == "<s>"

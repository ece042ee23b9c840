"""A GGUF's tokenizer is converted once and kept under the cache dir (tiffin.engine.models.source.load_tokenizer):
the next load reads the saved copy and tokenizes as the conversion does, a changed file is converted again, and a
cache that cannot be written, or holds a damaged copy, still gives the converted tokenizer."""

import errno
import json
import logging
import os
import shutil

import pytest
from gguf import GGMLQuantizationType as QType
from gguf_files import write_gguf
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tiffin.engine.models.source import load_tokenizer

TEXTS = ["Hello there", "<|im_start|>user\nhi<|im_end|>\n", "héllo 日本語 🙂\n\tdef f(): pass", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gguf_path(tiny_model, tmp_path_factory):
    return write_gguf(tiny_model("llama"), tmp_path_factory.mktemp("gguf") / "tiny.gguf", QType.F32)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The converted tokenizers' dir, under an XDG_CACHE_HOME of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "tiffin" / "tokenizers"


@pytest.fixture
def conversions(monkeypatch):
    """The GGUF files transformers converts from here on; `conversions.refuse = True` makes converting raise."""
    convert = AutoTokenizer.from_pretrained

    class Conversions(list):
        refuse = False

    done = Conversions()

    def from_pretrained(path, *args, **kwargs):
        if "gguf_file" in kwargs:
            assert not done.refuse, "converted again"
            done.append(kwargs["gguf_file"])
        return convert(path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    return done


def assert_same(tok, reference) -> None:
    """Both encode (special tokens too), number and template as one: what the engine reads of a tokenizer."""

    def facts(t) -> tuple:
        ids = [t.encode(text) for text in TEXTS], t.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        chat = t.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
        return *ids, t.bos_token_id, t.eos_token_id, len(t), t.chat_template, chat

    assert facts(tok) == facts(reference)


def test_a_second_load_reads_the_saved_copy(gguf_path, cache, conversions):
    converted = load_tokenizer(str(gguf_path))
    assert conversions == ["tiny.gguf"] and len(list(cache.iterdir())) == 1
    conversions.refuse = True
    assert_same(load_tokenizer(str(gguf_path)), converted)
    assert_same(load_tokenizer(str(gguf_path.parent)), converted)  # a directory holding the one GGUF


def test_a_changed_gguf_is_converted_again(gguf_path, cache, tiny_model, tmp_path, conversions):
    hf = shutil.copytree(tiny_model("llama"), tmp_path / "hf")
    path = shutil.copy(gguf_path, tmp_path / "model.gguf")
    first = load_tokenizer(path)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "{{ 'changed' }}"}))
    write_gguf(hf, path, QType.F32)  # the same file, another chat template
    second = load_tokenizer(path)
    assert (first.chat_template, second.chat_template) == (config["chat_template"], "{{ 'changed' }}")
    assert conversions == ["model.gguf"] * 2 and len(list(cache.iterdir())) == 2


def test_an_unwritable_cache_still_gives_the_converted_tokenizer(gguf_path, cache, caplog):
    cache.parent.parent.mkdir(parents=True)
    cache.parent.write_text("a file where tiffin's cache dir would be")  # as root, chmod would not stop a write
    with caplog.at_level(logging.WARNING, logger="tiffin.engine.models.source"):
        first, second = load_tokenizer(str(gguf_path)), load_tokenizer(str(gguf_path))
    assert_same(first, AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name))
    assert_same(second, first)
    assert [r.getMessage() for r in caplog.records if "not cached" in r.getMessage()] == [
        f"tokenizers converted from GGUF are not cached in {cache} (Not a directory): each load converts again"
    ]


def test_a_save_failing_midway_leaves_no_copy(gguf_path, cache, conversions, monkeypatch):
    save = PreTrainedTokenizerBase.save_pretrained

    def disk_full(self, *args, **kwargs):  # after writing all it writes: a copy in place would look whole
        save(self, *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    converted = load_tokenizer(str(gguf_path))
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", save)
    assert_same(load_tokenizer(str(gguf_path)), converted)
    assert conversions == ["tiny.gguf"] * 2 and len(list(cache.iterdir())) == 1


def test_a_damaged_copy_is_converted_again_and_replaced(gguf_path, cache, conversions):
    converted = load_tokenizer(str(gguf_path))
    [entry] = cache.iterdir()
    (entry / "tokenizer.json").write_text('{"truncated": ')
    assert_same(load_tokenizer(str(gguf_path)), converted)
    conversions.refuse = True
    assert_same(load_tokenizer(str(gguf_path)), converted)
    assert conversions == ["tiny.gguf"] * 2


def test_a_digit_splitting_pre_tokenizer_is_kept(gguf_path, tiny_model, tmp_path, cache, conversions):
    """llama.cpp's `smollm` pre-tokenizer (SmolLM's own: each digit a word, then GPT-2's regex), which transformers'
    conversion drops: whitespace before a digit stays one word, as llama.cpp tokenizes it; a file naming no
    pre-tokenizer keeps GPT-2's regex."""
    words = lambda tok: [w for w, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x\n   2 10")]
    smollm = write_gguf(tiny_model("llama"), tmp_path / "smollm.gguf", QType.F32, pre="smollm")
    assert words(load_tokenizer(str(smollm))) == ["x", "ĊĠĠĠ", "2", "Ġ", "1", "0"]
    conversions.refuse = True
    assert words(load_tokenizer(str(smollm))) == ["x", "ĊĠĠĠ", "2", "Ġ", "1", "0"]  # the saved copy
    conversions.refuse = False
    assert words(load_tokenizer(str(gguf_path))) == ["x", "ĊĠĠ", "Ġ2", "Ġ10"]

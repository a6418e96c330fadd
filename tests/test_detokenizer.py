"""IncrementalDetokenizer against real (locally trained) tokenizers: a byte-level BPE like
GPT-2/Llama-3/SmolLM, and a SentencePiece-like BPE with byte fallback like Llama-2."""
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.stream_detokenizer import StreamDetokenizer, make_detokenizer

WORDS = ("héllo wörld 你好 🙂 the quick brown fox jumps over lazy dog café naïve Zürich 日本語 "
         "テキスト 👍🏽 résumé 東京 😀 data model token stream , . ! ? 's don't").split()
# Characters absent from the training corpus: they are split into byte tokens.
RARE = ["猫", "🚀", "ß", "Ωμέγα", "👨‍👩‍👧", "한국어", "€", "ñ", "\n", "  "]


def _corpus(n=400, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def _texts(n, seed):
    rng = random.Random(seed)
    pool = WORDS + RARE
    return [rng.choice(["", " "]) + " ".join(rng.choice(pool) for _ in range(rng.randint(1, 20)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def byte_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sentencepiece_like():
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(_corpus(), trainer)
    # Byte-fallback tokens <0x00>..<0xFF> as in Llama-2's vocabulary.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    vocab.update({f"<0x{b:02X}>": base + b for b in range(256)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


class PlainDecode:
    """A tokenizer seen only through its Python API (no backend_tokenizer), so the
    detokenizer takes its generic tokenizer.decode path instead of the Rust shortcut."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


@pytest.fixture(params=["byte_bpe", "sentencepiece_like", "plain_decode"])
def tokenizer(request):
    if request.param == "plain_decode":
        return PlainDecode(request.getfixturevalue("sentencepiece_like"))
    return request.getfixturevalue(request.param)


def _stream(detok, ids, rng=None, flush=True):
    """Feed ids one at a time (or in random chunks with rng); returns the emitted pieces."""
    pieces, i = [], 0
    while i < len(ids):
        step = 1 if rng is None else rng.randint(1, 4)
        text, stop = detok.add(ids[i:i + step])
        pieces.append(text)
        i += step
        if stop is not None:
            return pieces
    if flush:
        pieces.append(detok.flush())
    return pieces


def test_fixtures_exercise_byte_splits(byte_bpe, sentencepiece_like):
    # Guard: the tokenizers really split characters over several tokens, else the tests
    # below would pass trivially.
    for tok in (byte_bpe, sentencepiece_like):
        ids = tok.encode("猫🚀", add_special_tokens=False)
        assert len(ids) >= 4
        assert any(tok.decode([i]).endswith("\ufffd") for i in ids)


def test_streaming_equals_full_decode_on_real_text(tokenizer):
    rng = random.Random(1)
    for text in _texts(150, seed=2):
        ids = tokenizer.encode(text, add_special_tokens=False)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        for chunked in (None, rng):
            detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], [])
            pieces = _stream(detok, ids, chunked)
            assert "".join(pieces) == expected
            assert detok.text == expected
            if "\ufffd" not in expected:
                assert not any("\ufffd" in p for p in pieces), (text, pieces)


def test_leading_space_follows_decode(sentencepiece_like):
    ids = sentencepiece_like.encode(" héllo wörld", add_special_tokens=False)
    expected = sentencepiece_like.decode(ids)
    detok = IncrementalDetokenizer(sentencepiece_like, [5, 6], [])
    assert "".join(_stream(detok, ids)) == expected
    assert not expected.startswith(" ")  # the Strip decoder removed it, and so did we


def test_streaming_equals_full_decode_on_random_ids(tokenizer):
    # Arbitrary id sequences include lone continuation bytes and special tokens. Byte-fallback
    # tokens are left out: their invalid runs are the one case decode is not prefix-stable
    # (next test).
    rng = random.Random(3)
    ids_pool = [i for t, i in tokenizer.get_vocab().items() if not t.startswith("<0x")]
    for _ in range(200):
        ids = [rng.choice(ids_pool) for _ in range(rng.randint(1, 30))]
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(tokenizer, [], [])
        assert "".join(_stream(detok, ids, rng)) == expected


def test_invalid_byte_run_does_not_stall(sentencepiece_like):
    # "猫" then a stray continuation byte: the byte-fallback decoder now renders the whole
    # run as U+FFFD, so it no longer agrees with what was already released. The stream must
    # keep going (as vLLM's does) rather than wait for agreement that never comes.
    tok = sentencepiece_like
    byte = tok.convert_tokens_to_ids
    cat = tok.encode("猫", add_special_tokens=False)
    dog = tok.encode("fox dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], [])
    pieces = [detok.add([i])[0] for i in cat + [byte("<0x8C>")] + dog]
    streamed = "".join(pieces)
    assert "猫" in streamed and streamed.endswith("fox dog")
    assert detok.flush() == ""


def test_special_tokens_kept_when_not_skipped(byte_bpe):
    ids = byte_bpe.encode("héllo", add_special_tokens=False) + [byte_bpe.eos_token_id]
    detok = IncrementalDetokenizer(byte_bpe, [], [], skip_special_tokens=False)
    assert "".join(_stream(detok, ids)) == "héllo<|endoftext|>"
    detok = IncrementalDetokenizer(byte_bpe, [], [])
    assert "".join(_stream(detok, ids)) == "héllo"


def test_incomplete_character_flushed_as_decode_gives_it(byte_bpe):
    ids = byte_bpe.encode("ab猫", add_special_tokens=False)[:-1]  # cut inside 猫
    detok = IncrementalDetokenizer(byte_bpe, [], [])
    streamed = "".join(detok.add([i])[0] for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == byte_bpe.decode(ids)
    assert byte_bpe.decode(ids).endswith("\ufffd")


def _check_stop(tokenizer, text, stops, include=False, rng=None):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, [], stops, include_stop_str_in_output=include)
    pieces = _stream(detok, ids, rng, flush=False)
    found = [(full.find(s), s) for s in stops if s in full]
    if not found:
        pieces.append(detok.flush())
        assert "".join(pieces) == full
        return None
    # The first to complete wins; of two ending together, the one starting first.
    pos, stop = min(found, key=lambda f: (f[0] + len(f[1]), f[0]))
    assert detok.stop_hit == stop
    expected = full[:pos + len(stop)] if include else full[:pos]
    assert "".join(pieces) == expected
    # Before the stop was reported, nothing emitted ran past the text preceding the stop.
    assert full[:pos].startswith("".join(pieces[:-1]))
    assert detok.add(ids[:3]) == ("", None) and detok.flush() == ""
    return stop


def test_stop_string_spanning_tokens_never_leaks(tokenizer):
    rng = random.Random(4)
    texts = _texts(120, seed=5)
    hits = 0
    for text in texts:
        words = text.split()
        # A stop string made of the end of one word and the start of the next spans tokens.
        k = rng.randrange(len(words))
        stop = (words[k][-2:] + " " + words[k + 1][:2]) if k + 1 < len(words) else words[k]
        for include in (False, True):
            hits += _check_stop(tokenizer, text, [stop], include, rng if include else None) is not None
    assert hits > 100


def test_multibyte_stop_string(tokenizer):
    assert _check_stop(tokenizer, "the fox 你好 🚀 data", ["🚀"]) == "🚀"
    assert _check_stop(tokenizer, "the fox 你好 🚀 data", ["好 🚀 d"], include=True) == "好 🚀 d"


def test_stop_at_first_token(byte_bpe):
    ids = byte_bpe.encode("hello there", add_special_tokens=False)
    first = byte_bpe.decode(ids[:1])
    detok = IncrementalDetokenizer(byte_bpe, [], [first])
    assert detok.add(ids[:1]) == ("", first)
    assert detok.text == ""
    detok = IncrementalDetokenizer(byte_bpe, [], [first], include_stop_str_in_output=True)
    assert detok.add(ids) == (first, first)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    text = "the quick brown fox jumps over lazy dog"
    assert _check_stop(tokenizer, text, ["lazy", "fox", "quick brown fox"]) == "quick brown fox"
    assert _check_stop(tokenizer, text, ["over", "brown f"], include=True) == "brown f"
    # "bro" completes before "brown" could, however the ids are split into add() calls.
    assert _check_stop(tokenizer, text, ["brown", "bro"]) == "bro"
    assert _check_stop(tokenizer, text, ["brown", "bro"], rng=random.Random(0)) == "bro"
    # A stop inside a longer one's span completes first.
    assert _check_stop(tokenizer, text, ["quick brown fox", "brown"]) == "brown"


def test_prefix_of_stop_that_never_completes_is_flushed(byte_bpe):
    ids = byte_bpe.encode("the quick bro", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, [], ["brown fox"])
    streamed = "".join(detok.add([i])[0] for i in ids)
    assert streamed == "the quick "  # "bro" might still become "brown fox"
    assert detok.flush() == "bro"
    assert detok.text == "the quick bro"


def test_held_prefix_released_once_it_diverges(byte_bpe):
    ids = byte_bpe.encode("the lazy dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, [], ["lazy cat"])
    pieces = [detok.add([i])[0] for i in ids]
    assert "".join(pieces) == "the lazy dog"  # nothing of it can still start "lazy cat"
    assert detok.stop_hit is None and detok.flush() == ""


def test_min_tokens_holds_stop_strings_off(byte_bpe):
    """vLLM's rule: a stop string counts only in the text of output tokens after the first
    min_tokens; the same stop string later still ends the output."""
    text = "the fox jumps over the fox again"
    ids = byte_bpe.encode(text, add_special_tokens=False)
    first_fox = next(k for k in range(1, len(ids) + 1) if "fox" in byte_bpe.decode(ids[:k]))
    detok = IncrementalDetokenizer(byte_bpe, [], ["fox"])
    "".join(detok.add([i])[0] for i in ids)
    assert detok.stop_hit == "fox" and detok.text == "the "
    detok = IncrementalDetokenizer(byte_bpe, [], ["fox"], min_tokens=first_fox)
    streamed = "".join(detok.add([i])[0] for i in ids)
    assert detok.stop_hit == "fox"
    assert streamed == detok.text == text[:text.index("fox", text.index("fox") + 1)]
    # min_tokens past every stop: the whole text, flushed at the end.
    detok = IncrementalDetokenizer(byte_bpe, [], ["fox"], min_tokens=len(ids))
    streamed = "".join(detok.add([i])[0] for i in ids) + detok.flush()
    assert detok.stop_hit is None and streamed == text


# -- the stream detokenizer (serving/engine/stream_detokenizer.py) ---------------------------

def test_requests_without_stop_strings_on_byte_level_tokenizers_stream(byte_bpe,
                                                                      sentencepiece_like):
    assert isinstance(make_detokenizer(byte_bpe, [1, 2]), StreamDetokenizer)
    assert isinstance(make_detokenizer(byte_bpe, [], [""]), StreamDetokenizer)  # no stop
    for tok, stop in ((byte_bpe, ["fox"]), (sentencepiece_like, None),
                      (PlainDecode(byte_bpe), None)):
        assert type(make_detokenizer(tok, [], stop)) is IncrementalDetokenizer


def test_the_demo_tokenizer_streams(demo_model_dir):
    tok = PreTrainedTokenizerFast.from_pretrained(str(demo_model_dir))
    detok = make_detokenizer(tok, [])
    assert isinstance(detok, StreamDetokenizer)
    text = "The capital of France is Paris. Ça coûte 5 € 🙂"
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(_stream(detok, ids)) == text


def test_stream_equals_full_decode_on_random_ids(byte_bpe):
    """Lone continuation bytes, special tokens, ids fed in random chunks."""
    rng = random.Random(5)
    pool = list(byte_bpe.get_vocab().values())
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        detok = make_detokenizer(byte_bpe, [])
        pieces = _stream(detok, ids, rng)
        assert "".join(pieces) == detok.text == byte_bpe.decode(ids, skip_special_tokens=True)


def test_stream_holds_an_incomplete_character_until_flushed(byte_bpe):
    ids = byte_bpe.encode("ab猫", add_special_tokens=False)
    detok = make_detokenizer(byte_bpe, [])
    streamed = "".join(detok.add([i])[0] for i in ids[:-1])  # cut inside 猫
    assert streamed == "ab"
    assert detok.add(ids[-1:])[0] == "猫" and detok.flush() == ""
    detok = make_detokenizer(byte_bpe, [])
    streamed = "".join(detok.add([i])[0] for i in ids[:-1])
    assert streamed + detok.flush() == byte_bpe.decode(ids[:-1]) == "ab\ufffd"


def test_stream_keeps_special_tokens_when_not_skipped(byte_bpe):
    ids = byte_bpe.encode("héllo", add_special_tokens=False) + [byte_bpe.eos_token_id]
    detok = StreamDetokenizer(byte_bpe.backend_tokenizer, skip_special_tokens=False)
    assert "".join(_stream(detok, ids)) == "héllo<|endoftext|>"

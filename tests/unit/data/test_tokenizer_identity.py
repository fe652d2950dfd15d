"""What a checkpoint records of its tokenizer (``data.tokenizer.identity``): the vocabulary's
SHA-256 and that of everything else that decides how text becomes ids. The same pieces under
another normalization tokenize every prompt differently, so they must not pass for the same
tokenizer; the same tokenizer read twice, or with run-time padding set, must."""

from __future__ import annotations

import json

from sentencepiece import sentencepiece_model_pb2

from loggra_megatron.data.hf_tokenizer import HuggingFaceTokenizer
from loggra_megatron.data.tokenizer import SentencePieceTokenizer, identity


def _flipped_dummy_prefix(model_path, out_path) -> None:
    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    proto.normalizer_spec.add_dummy_prefix = not proto.normalizer_spec.add_dummy_prefix
    with open(out_path, "wb") as f:
        f.write(proto.SerializeToString())


def test_sentencepiece_normalization_is_part_of_the_identity(tokenizer, tmp_path):
    flipped = tmp_path / "flipped.model"
    _flipped_dummy_prefix(tokenizer, flipped)
    a, b = SentencePieceTokenizer(tokenizer), SentencePieceTokenizer(flipped)
    assert a.vocabulary() == b.vocabulary()
    assert a.tokenize("What is 2+3?") != b.tokenize("What is 2+3?")  # what the flip changes
    ours, theirs = identity(a), identity(b)
    assert ours["tokenizer"] == theirs["tokenizer"]
    assert ours["tokenizer_encoding"] != theirs["tokenizer_encoding"]
    assert identity(SentencePieceTokenizer(tokenizer)) == ours


def _hf_dir(path, lowercase: bool):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "what", "What", "is", "two"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


def test_hugging_face_normalizer_is_part_of_the_identity(tmp_path):
    plain = HuggingFaceTokenizer(_hf_dir(tmp_path / "plain", lowercase=False))
    lower = HuggingFaceTokenizer(_hf_dir(tmp_path / "lower", lowercase=True))
    assert plain.vocabulary() == lower.vocabulary()
    assert plain.tokenize("What is two") != lower.tokenize("What is two")
    ours, theirs = identity(plain), identity(lower)
    assert ours["tokenizer"] == theirs["tokenizer"]
    assert ours["tokenizer_encoding"] != theirs["tokenizer_encoding"]
    # run-time padding and truncation are not part of it
    plain._tok.backend_tokenizer.enable_padding(length=8)
    plain._tok.backend_tokenizer.enable_truncation(max_length=4)
    assert identity(plain) == ours
    spec = json.loads(plain.encoding_spec())
    assert "padding" not in spec and "truncation" not in spec

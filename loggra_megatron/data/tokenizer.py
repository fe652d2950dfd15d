# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Tokenizers (``--tokenizer-type``, ``--tokenizer-model``): a SentencePiece model and a
trainer for small ones; ``load_tokenizer`` also opens Hugging Face tokenizer directories
(``data.hf_tokenizer``).

``SentencePieceTokenizer`` wraps a ``.model`` file with the interface the RL stack
uses (Megatron's tokenizer vocabulary): ``tokenize``, ``detokenize``, ``vocab_size``,
``bos``, ``eos`` (= ``eod``), ``pad``. ``tokenize`` adds no BOS/EOS; ``detokenize`` drops
control ids (BOS/EOS/PAD).

``train_tokenizer`` trains a model from in-memory text with settings chosen so that a
tiny model can learn arithmetic (every digit its own piece) and the round trip is exact
(``detokenize(tokenize(x)) == x``); ``tools/train_tokenizer.py`` is its command line.

The trainer's settings and why: docs/data.md#training-a-sentencepiece-tokenizer
"""

from __future__ import annotations

import hashlib
import io
import os
import string
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import sentencepiece as spm

from loggra_megatron.tasks.prompt_format import ANSWER_MARKER

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
REQUIRED_CHARS = "".join(c for c in string.printable if not c.isspace()) + "\t"
USER_DEFINED_SYMBOLS = ("\n", ANSWER_MARKER)


class Tokenizer(Protocol):
    """What the RL stack reads of a tokenizer (``SentencePieceTokenizer``,
    ``HuggingFaceTokenizer``)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos(self) -> int | None: ...

    @property
    def eos(self) -> int: ...

    @property
    def pad(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a completion."""
        ...

    @property
    def has_chat_template(self) -> bool: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Iterable[int]) -> str: ...

    def render_chat(self, messages: list[dict]) -> str: ...

    def vocabulary(self) -> list[str]:
        """Every token's text, in id order."""
        ...

    def encoding_spec(self) -> bytes:
        """What decides how text becomes ids beyond the pieces: the normalizer and its
        settings, the pre-tokenizer, the model's own rules."""
        ...


def fingerprint(tokenizer: Tokenizer) -> str:
    """SHA-256 of the tokenizer's pieces in id order: the same for the same vocabulary,
    whatever file it came from; different when any id means another piece (a resume onto
    such a tokenizer would train on scrambled ids, even at the same vocabulary size)."""
    digest = hashlib.sha256()
    for piece in tokenizer.vocabulary():
        digest.update(piece.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


def identity(tokenizer: Tokenizer) -> dict[str, str]:
    """What a checkpoint records of its tokenizer (``run_config.json``): ``tokenizer``, the
    vocabulary's ``fingerprint``, and ``tokenizer_encoding``, the SHA-256 of its
    ``encoding_spec``: the same pieces under another normalization (e.g. sentencepiece's
    ``add_dummy_prefix`` flipped) tokenize every prompt differently."""
    spec = hashlib.sha256(tokenizer.encoding_spec()).hexdigest()
    return {"tokenizer": fingerprint(tokenizer), "tokenizer_encoding": spec}


class SentencePieceTokenizer:
    """A trained SentencePiece model (``--tokenizer-model``)."""

    def __init__(self, model_path: str | os.PathLike):
        model_path = os.fspath(model_path)
        if not os.path.isfile(model_path):
            raise FileNotFoundError(
                f"--tokenizer-model {model_path!r}: no such file (train one with "
                "`python tools/train_tokenizer.py --builtin-tasks 20000 --output-prefix PREFIX`)"
            )
        self.model_path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            raise ValueError(
                f"--tokenizer-model {model_path!r}: not a sentencepiece model ({e})"
            ) from e

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (a list, or a 1-D tensor / array); BOS/EOS/PAD decode to ''."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._sp.decode([int(i) for i in ids])

    def encoding_spec(self) -> bytes:
        """The whole serialized model proto: pieces, normalizer and denormalizer specs and
        the trainer settings that encoding reads (byte fallback, digit splitting)."""
        return self._sp.serialized_model_proto()

    def pieces(self, text: str) -> list[str]:
        """The pieces ``text`` is split into (for inspection; spaces show as ``▁``)."""
        return self._sp.encode(text, out_type=str)

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def vocabulary(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def eod(self) -> int:
        """End of document (Megatron's name for EOS)."""
        return self.eos

    @property
    def pad(self) -> int:
        """The ``<pad>`` id; models trained without one pad with EOS."""
        pad = self._sp.pad_id()
        return pad if pad >= 0 else self.eos

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a completion."""
        return (self.eos,)

    @property
    def has_chat_template(self) -> bool:
        return False

    def render_chat(self, messages: list[dict]) -> str:
        raise ValueError(
            f"{self.model_path}: a sentencepiece model has no chat template; use a Hugging Face "
            "tokenizer directory (--tokenizer-type HuggingFaceTokenizer) for chat prompts"
        )

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")
"""Megatron-LM's ``--tokenizer-type`` names this stack reads."""


def load_tokenizer(path: str, kind: str | None = None) -> Tokenizer:
    """``--tokenizer-model`` as ``kind`` (default: a directory is a Hugging Face tokenizer,
    a file a sentencepiece model). Raises ``ValueError`` naming the flag."""
    kind = kind or ("HuggingFaceTokenizer" if os.path.isdir(path) else "SentencePieceTokenizer")
    if kind == "HuggingFaceTokenizer":
        from loggra_megatron.data.hf_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(path)
    try:
        return SentencePieceTokenizer(path)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None


def with_required_chars(
    texts: Iterable[str], required_chars: str, user_defined_symbols: Sequence[str]
) -> Iterator[str]:
    """``texts``, then one one-character sentence per required character that none of them
    shows outside a user-defined symbol (``#`` inside ``####`` is the symbol, not ``#``).

    SentencePiece < 0.2.3 aborts the whole process (``CHECK freq > 0`` in its BPE trainer,
    no exception) on a required character the corpus never shows; 0.2.3 counts such a
    character once, so its models are bitwise those it trains without these sentences, and
    a one-character sentence adds no pair to merge."""
    seen: set[str] = set()
    for text in texts:
        shown = text
        for symbol in user_defined_symbols:
            shown = shown.replace(symbol, "")
        seen.update(shown)
        yield text
    yield from (c for c in dict.fromkeys(required_chars) if c not in seen)


def train_tokenizer(
    texts: Iterable[str],
    prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    byte_fallback: bool = False,
    user_defined_symbols: Sequence[str] = USER_DEFINED_SYMBOLS,
    required_chars: str = REQUIRED_CHARS,
    hard_vocab_limit: bool = False,
    num_threads: int = 1,
    max_sentence_length: int = 16384,
) -> str:
    """Train a SentencePiece model on ``texts``; write ``{prefix}.model`` and
    ``{prefix}.vocab`` and return the ``.model`` path.

    With ``hard_vocab_limit=False`` (default) a corpus too small for ``vocab_size`` yields
    a smaller vocabulary instead of an error; read the actual size from
    ``SentencePieceTokenizer.vocab_size``. The fixed settings (digits split, exact round
    trip, atomic ``"\\n"`` and ``####``, the control ids, determinism):
    docs/data.md#training-a-sentencepiece-tokenizer.
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    prefix = os.fspath(prefix)
    directory = os.path.dirname(prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=with_required_chars(texts, required_chars, user_defined_symbols),
        model_writer=model,
        model_type=model_type,
        vocab_size=vocab_size,
        hard_vocab_limit=hard_vocab_limit,
        split_digits=True,
        byte_fallback=byte_fallback,
        user_defined_symbols=list(user_defined_symbols),
        required_chars=required_chars,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=max_sentence_length,
        num_threads=num_threads,
        minloglevel=2,
    )
    model_path = prefix + ".model"
    with open(model_path, "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    lost = [c for c in dict.fromkeys(required_chars) if sp.piece_to_id(c) == sp.unk_id()]
    if lost:  # SentencePiece 0.2.2 makes no piece of a tab, even one the corpus shows
        warnings.warn(
            f"sentencepiece {spm.__version__} kept no piece for the required characters "
            f"{''.join(lost)!r}: they tokenize to <unk> (sentencepiece >= 0.2.3 keeps them; "
            "or --byte-fallback)",
            stacklevel=2,
        )
    with open(prefix + ".vocab", "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n")
    return model_path

"""A Hugging Face tokenizer directory (``--tokenizer-type HuggingFaceTokenizer``).

``HuggingFaceTokenizer`` wraps ``transformers.AutoTokenizer`` (local files only: a
directory with ``tokenizer.json`` / ``tokenizer_config.json``, as every Llama 3.x and
Qwen2.5/Qwen3 model ships) with the interface the RL stack uses: ``tokenize`` (no special
tokens added), ``detokenize`` (special tokens dropped), ``vocab_size`` (``len(tokenizer)``,
added tokens included), ``bos`` (None when the model has none, e.g. Qwen), ``eos``, ``pad``
(``pad_token`` or EOS), ``stop_ids`` (EOS plus every ``eos_token_id`` of the directory's
``generation_config.json``: Qwen's chat models stop at ``<|im_end|>`` *and*
``<|endoftext|>``), and the chat template (``render_chat``:
``apply_chat_template(messages, add_generation_prompt=True)``).
"""

from __future__ import annotations

import json
import os


class HuggingFaceTokenizer:
    """A tokenizer directory read with ``transformers.AutoTokenizer`` (offline)."""

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoTokenizer

        self.model_path = os.fspath(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--tokenizer-model {self.model_path!r}: not a Hugging Face tokenizer directory "
                f"({e})"
            ) from e
        if self._tok.eos_token_id is None:
            raise ValueError(f"--tokenizer-model {self.model_path!r}: the tokenizer has no EOS")
        self._stop_ids = (self._tok.eos_token_id, *self._generation_eos())

    def _generation_eos(self) -> list[int]:
        path = os.path.join(self.model_path, "generation_config.json")
        if not os.path.isfile(path):
            return []
        try:
            with open(path, "rb") as f:
                eos = json.loads(f.read()).get("eos_token_id")
            ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
            return [int(i) for i in ids if int(i) != self._tok.eos_token_id]
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(
                f"--tokenizer-model {self.model_path!r}: {path} is not a readable generation "
                f"config ({type(e).__name__}: {e}); fix or remove it"
            ) from None

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in the text are parsed, none are added)."""
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def vocabulary(self) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(range(len(self._tok))))]

    def encoding_spec(self) -> bytes:
        """A fast tokenizer's ``tokenizer.json`` (normalizer, pre-tokenizer, model, added
        tokens, post-processor) less the run-time ``truncation`` and ``padding``, keys
        sorted; a slow one's class and vocabulary."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return "\0".join([type(self._tok).__name__, *self.vocabulary()]).encode()
        spec = json.loads(backend.to_str())
        for volatile in ("truncation", "padding"):
            spec.pop(volatile, None)
        return json.dumps(spec, sort_keys=True, ensure_ascii=False).encode()

    @property
    def bos(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def eos(self) -> int:
        return self._tok.eos_token_id

    @property
    def pad(self) -> int:
        return self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def has_chat_template(self) -> bool:
        return getattr(self._tok, "chat_template", None) is not None

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text of ``messages`` with the assistant turn opened."""
        if not self.has_chat_template:
            raise ValueError(f"--tokenizer-model {self.model_path!r} has no chat template")
        return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"

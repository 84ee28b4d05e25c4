"""The Kimi-shaped stand-in's tokenizer: custom code loaded through ``auto_map``, as Kimi-K2.5's is.

Written for the project's stand-in (tests/support/kimi_standin.py) with the interface of Kimi-K2.5's
``tokenization_kimi.TikTokenTokenizer``: a Python (slow) transformers tokenizer over a tiktoken
BPE file (``tiktoken.model``: 163,584 ranks) plus 256 reserved special tokens (163,840 ids), the
same pre-tokenizing pattern (runs of Han characters split apart), ``encode`` that turns special
token strings in the text into their ids and adds no BOS, and ``apply_chat_template`` whose
defaults add the generation prompt. What the pipeline must survive is all here: no Rust
tokenizer, no character offsets, and a chat-template call that appends a prompt unless told not to.
"""

from __future__ import annotations

import os
from pathlib import Path
from shutil import copyfile
from typing import Any, ClassVar

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
NUM_RESERVED_SPECIAL_TOKENS = 256
# Kimi's pattern: Han runs apart, cased words with contractions, 1-3 digits, punctuation, spaces.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
MAX_CHUNK_CHARS = 400_000  # tiktoken's recursion limits: encode long texts in pieces


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str | None = None,
        pad_token: str | None = None,
        additional_special_tokens: list[str] | None = None,
        added_tokens_decoder: dict[int, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_file = vocab_file
        mergeable_ranks = load_tiktoken_bpe(vocab_file)
        num_base_tokens = len(mergeable_ranks)
        named = {
            int(i): (t.content if hasattr(t, "content") else str(t))
            for i, t in (added_tokens_decoder or {}).items()
        }
        self.special_tokens = {
            named.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS)
        }
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = self.model.n_vocab
        byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in byte_encoder.items()}
        self.decoder = {
            i: "".join(byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
            for i in range(num_base_tokens)
        }
        self.decoder.update({i: token for token, i in self.special_tokens.items()})
        self.encoder = {token: i for i, token in self.decoder.items()}
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            additional_special_tokens=additional_special_tokens,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs and set(kwargs) != {"add_special_tokens"}:
            return super().encode(text, **kwargs)
        allowed: Any = "all" if allow_special_tokens else set()
        ids: list[int] = []
        for start in range(0, len(text), MAX_CHUNK_CHARS):
            ids += self.model.encode(
                text[start : start + MAX_CHUNK_CHARS],
                allowed_special=allowed,
                disallowed_special=(),
            )
        return ids

    def decode(self, token_ids: Any, **kwargs: Any) -> str:
        if kwargs:
            return super().decode(token_ids, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.model.decode(ids)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, "")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray(self.byte_decoder[c] for c in "".join(tokens))
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple:
        out = os.path.join(
            save_directory, (filename_prefix or "") + VOCAB_FILES_NAMES["vocab_file"]
        )
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)

    def apply_chat_template(
        self,
        conversation: Any,
        tools: Any = None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> Any:
        # Kimi's defaults: text, and the generation prompt appended unless asked otherwise.
        return super().apply_chat_template(
            conversation,
            tools=tools,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

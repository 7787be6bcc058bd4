"""The Kimi-K2.5 twin's tokenizer: a tiktoken BPE loaded through `trust_remote_code`, packaged as
Kimi-K2.5 packages its own (`tokenization_kimi.py` + `tiktoken.model` + an `auto_map` in
tokenizer_config.json). Written for the eagle3-train twin; not Moonshot's file.

Layout as in Kimi: the BPE ranks fill ids 0 .. n-1, then 256 special ids n .. n+255 named
`<|reserved_token_i|>` unless tokenizer_config.json's `added_tokens_decoder` names them
([BOS], [EOS], <|im_end|>, <think>, ...). Token strings are the byte-level (GPT-2) spelling of each
token's bytes, so incremental detokenizers (vLLM's) can join them.
"""

from __future__ import annotations

import os
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AddedToken, PreTrainedTokenizer

NUM_RESERVED_SPECIAL = 256
# Digits one per token (the twin's arithmetic needs them), otherwise GPT-2-like pieces.
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_chars() -> dict[int, str]:
    """Each byte -> one printable character (printable ASCII/Latin-1 keep their own)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
                 pad_token="[PAD]", added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        n = len(ranks)
        specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + NUM_RESERVED_SPECIAL)}
        named = {int(i): str(t) for i, t in (added_tokens_decoder or {}).items()}
        for i, name in named.items():
            specials.pop(f"<|reserved_token_{i}|>", None)
            specials[name] = i
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=specials)
        self.n_words = n + NUM_RESERVED_SPECIAL
        chars = _byte_chars()
        self._byte_of = {c: b for b, c in chars.items()}
        self.decoder = {r: "".join(chars[b] for b in tok) for tok, r in ranks.items()}
        self.decoder.update({i: s for s, i in specials.items()})
        self.encoder = {s: i for i, s in self.decoder.items()}
        decoder = {i: AddedToken(s, special=True, normalized=False) if isinstance(s, str) else s
                   for i, s in (added_tokens_decoder or {}).items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        # Special tokens were split off already (added tokens); the rest is plain text.
        return [self.decoder[t] for t in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        out, pending = [], bytearray()
        for t in tokens:
            if t in self._added_tokens_encoder or t not in self.encoder or any(c not in self._byte_of for c in t):
                out.append(pending.decode("utf-8", "replace"))
                pending = bytearray()
                out.append(t)
            else:
                pending += bytes(self._byte_of[c] for c in t)
        out.append(pending.decode("utf-8", "replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        name = (filename_prefix + "-" if filename_prefix else "") + self.vocab_files_names["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)

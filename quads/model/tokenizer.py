"""Tokenizers: the ``Tokenizer`` protocol, ``CharTokenizer`` for the built-in model, ``HFTokenizer``.

``encode`` never adds special tokens; the rollout engine prepends ``bos_id`` to string prompts when the
tokenizer has one, and the SFT/RL data code does the same (so both sides see identical ids).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from quads.errors import UsageError
from quads.io import atomic_write_json

TOKENIZER_FILE = "tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """One id per character: 4 specials then printable ASCII (space..~) and newline; 100 ids.

    Ids are fixed (no training), so a checkpoint's tokenizer file only records the kind and the
    alphabet. Characters outside the alphabet encode to ``<unk>``; decoding skips special and
    out-of-vocabulary ids.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # printable ASCII without \t\r\x0b\x0c

    def __init__(self, alphabet: str | None = None) -> None:
        self.alphabet = alphabet if alphabet is not None else self.ALPHABET
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError("CharTokenizer alphabet has repeated characters")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(4)
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(self.alphabet)}
        self._to_char = dict(enumerate(self.SPECIALS)) | {i: c for c, i in self._to_id.items()}
        self.vocab_size = len(self.SPECIALS) + len(self.alphabet)
        # ASCII text maps byte by byte (``bytes.translate``): every byte to its id, <unk> where not in the
        # alphabet; ids must fit a byte (alphabets of up to 252 characters)
        self._ascii_ids = (bytes(self._to_id.get(chr(b), self.unk_id) for b in range(128)) + bytes(128)
                           if self.vocab_size <= 256 else None)

    def encode(self, text: str) -> list[int]:
        if self._ascii_ids is not None and text.isascii():
            return list(text.encode("ascii").translate(self._ascii_ids))
        return [self._to_id.get(c, self.unk_id) for c in text]

    def decode(self, ids: list[int]) -> str:
        n = len(self.SPECIALS)
        return "".join(self._to_char[i] for i in ids if n <= i < self.vocab_size)

    def save(self, folder: str | Path) -> None:
        atomic_write_json(Path(folder) / TOKENIZER_FILE, {"kind": "char", "alphabet": self.alphabet,
                                                           "specials": list(self.SPECIALS)})


class HFTokenizer:
    """A Hugging Face tokenizer read from a local folder (``tokenizer.json`` via ``tokenizers``).

    Special ids come from ``tokenizer_config.json`` (``eos_token``/``bos_token``/``pad_token``) and
    ``config.json`` (``eos_token_id``...), whichever names them; ``pad_id`` falls back to ``eos_id``.
    """

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"no {TOKENIZER_FILE} in {str(folder)!r}; HFTokenizer needs a fast-tokenizer file")
        self.folder = folder
        self.tok = _Tok.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")

        def special(name: str) -> int | None:
            tok = cfg.get(f"{name}_token")
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str) and self.tok.token_to_id(tok) is not None:
                return self.tok.token_to_id(tok)
            for src in (gen_cfg, model_cfg):
                val = src.get(f"{name}_token_id")
                if isinstance(val, list):
                    val = val[0] if val else None
                if isinstance(val, int):
                    return val
            return None

        eos = special("eos")
        if eos is None:
            raise ValueError(f"{str(folder)!r}: found no eos token in tokenizer_config.json, "
                             "generation_config.json or config.json; add eos_token to tokenizer_config.json")
        self.eos_id = eos
        self.bos_id = special("bos")
        pad = special("pad")
        self.pad_id = pad if pad is not None else eos

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: str | Path) -> None:
        import shutil

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"):
            if (self.folder / name).is_file() and (self.folder / name).resolve() != (folder / name).resolve():
                shutil.copyfile(self.folder / name, folder / name)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(folder: str | Path) -> CharTokenizer | HFTokenizer:
    """The tokenizer saved in ``folder``: a ``CharTokenizer`` file or an HF ``tokenizer.json``."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise UsageError(f"no {TOKENIZER_FILE} in {str(folder)!r}; a policy needs its tokenizer: save the checkpoint "
                         f"with its tokenizer or copy {TOKENIZER_FILE} from the model it came from")
    data = json.loads(path.read_text())
    if data.get("kind") == "char":
        return CharTokenizer(data["alphabet"])
    return HFTokenizer(folder)

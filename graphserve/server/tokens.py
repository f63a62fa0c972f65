"""What the server needs to know about the tokenizer's tokens: each token's own bytes (for logprobs) and how
many characters one token can cover at most (to refuse a prompt that cannot fit before tokenizing it)."""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

logger = logging.getLogger("graphserve.server")

# Normalizers that never make a text shorter: with them, every token covering at most L characters of the
# normalized text means at least len(text) / L tokens.
_NON_SHRINKING = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable bytes stand for themselves, the rest for 256 + i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _walk(node: Any) -> list[dict[str, Any]]:
    """A tokenizer.json component and the members of its Sequence, flattened."""
    if not isinstance(node, dict):
        return []
    members = node.get("normalizers") or node.get("pretokenizers") or node.get("decoders")
    return [n for m in members for n in _walk(m)] if members else [node]


class TokenTable:
    """Per-token facts of one tokenizer, computed once at startup."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        spec = self._spec(tokenizer)
        model = spec.get("model") or {}
        parts = _walk(spec.get("pre_tokenizer")) + _walk(spec.get("decoder"))
        self.byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        self.byte_fallback = bool(model.get("byte_fallback"))
        self.added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.max_chars_per_token = self._max_chars(tokenizer, spec)
        self._bytes: dict[int, bytes] = {}

    @staticmethod
    def _spec(tokenizer: Any) -> dict[str, Any]:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        return json.loads(backend.to_str()) if backend is not None else {}

    def _max_chars(self, tokenizer: Any, spec: dict[str, Any]) -> int | None:
        """The most characters of text one token can stand for, or None when no such bound holds: a tokenizer
        that maps a run of unknown characters to one <unk>, or that drops characters, covers any length."""
        if not (self.byte_level or self.byte_fallback):
            return None
        normalizers = _walk(spec.get("normalizer"))
        if any(n.get("type") not in _NON_SHRINKING or (n.get("type") == "Replace" and not n.get("content"))
               for n in normalizers):
            return None
        # Byte-level: a vocabulary entry of k characters is k bytes, hence at most k characters of text. With
        # byte fallback a piece stands for itself ("▁" for a space) and "<0xAB>" for one byte, shorter still.
        vocab = tokenizer.get_vocab()
        return max(len(t) for t in vocab) if vocab else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this one token stands for: for a byte-level token inside a multi-byte character these are
        that character's partial bytes, which decoding the token alone would turn into U+FFFD."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        if token_id in self.added:
            raw = self.added[token_id].encode("utf-8")
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            raw = self._piece_bytes(piece, token_id)
        if len(self._bytes) < 200_000:
            self._bytes[token_id] = raw
        return raw

    def _piece_bytes(self, piece: str | None, token_id: int) -> bytes:
        if piece is None:
            return b""
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if self.byte_fallback:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("▁", " ").encode("utf-8")
        # Neither scheme (e.g. WordPiece): the token's decoded text is the best there is.
        return self.tokenizer.decode([token_id]).encode("utf-8", errors="replace")

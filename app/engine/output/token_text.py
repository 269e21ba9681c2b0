"""What a token stands for on the output side: its raw bytes, and OpenAI-style keys for candidate tokens
(``top_logprobs``), distinct at a position."""

from __future__ import annotations

import json
import re
from functools import lru_cache

from app.engine.output.detokenize import IncrementalDetokenizer, tokenizer_memo

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (each byte is shown as one printable character)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's pieces are GPT-2 byte-level characters (decoder ``ByteLevel``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return "ByteLevel" in json.dumps(decoder)


def token_bytes(tokenizer, token_id: int, byte_level: bool = False) -> bytes:
    """The raw bytes a token stands for (byte-fallback ``<0xNN>``, byte-level BPE, or sentencepiece); kept per
    tokenizer once looked up."""
    known = tokenizer_memo(tokenizer, "bytes", dict)
    key = (int(token_id), byte_level)
    raw = known.get(key)
    if raw is None:
        raw = known[key] = _token_bytes(tokenizer, token_id, byte_level)
    return raw


def _token_bytes(tokenizer, token_id: int, byte_level: bool) -> bytes:
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    decoder = _byte_decoder()
    if piece and all(ch in decoder for ch in piece) and byte_level:
        return bytes(decoder[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


_ESCAPED = tuple(f"\\x{b:02x}" for b in range(256))  # each byte as ``\\xNN``


def bytes_key(raw: bytes) -> str:
    return "bytes:" + "".join(map(_ESCAPED.__getitem__, raw))


def candidate_keys(tokenizer, detok: IncrementalDetokenizer, ids: list[int], byte_level: bool = False) -> list[str]:
    """Distinct keys for candidate ``ids`` at the detokenizer's position: the text in context, or the
    ``bytes:\\xNN`` form where that text is empty, an incomplete character, or taken by an earlier id."""
    texts = detok.candidate_texts(ids)
    if all(texts) and len(set(texts)) == len(texts):  # the common case: each candidate's own text, distinct
        return texts  # type: ignore[return-value]
    keys: list[str] = []
    taken: set[str] = set()
    for token_id, text in zip(ids, texts):
        key = text if text else None
        if key is None or key in taken:
            key = bytes_key(token_bytes(tokenizer, token_id, byte_level))
            if key in taken or key == "bytes:":  # the tokenizer's own piece, else the id
                piece = tokenizer.convert_ids_to_tokens(int(token_id))
                if piece and piece not in taken:
                    key = piece
                else:
                    key = f"{key}<id:{token_id}>" if key != "bytes:" else f"<id:{token_id}>"
        taken.add(key)
        keys.append(key)
    return keys

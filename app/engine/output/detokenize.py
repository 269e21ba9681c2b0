"""Incremental detokenizer: token ids in, text deltas out, incomplete characters held back.

It keeps two offsets into the ids (as TGI's shard does): ``prefix_offset`` starts a few tokens of context
whose text is already out, ``read_offset`` is where unreleased ids begin. Decoding ``ids[prefix:]`` and
subtracting the text of ``ids[prefix:read]`` gives the new text as it reads in context, so a sentencepiece
piece keeps its leading space and a character spread over several byte tokens comes out with the token that
completes it. The concatenated deltas equal ``decode(all)[len(decode(first_ids)):]``.

Released text is never taken back. One case makes a full decode rewrite earlier text: byte-fallback decoders
turn a whole run of byte tokens into U+FFFD per byte once the run is invalid UTF-8 (a complete character
followed by a stray byte). Here the released characters stay and only the new ids are decoded (by themselves:
a stray byte reads as one U+FFFD).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def tokenizer_memo(tokenizer, name: str, make: Callable[[], object]):
    """``make()``, kept on the tokenizer as ``_saker_<name>`` so that it is worked out once per tokenizer (made
    again each time for a tokenizer that takes no attributes)."""
    attribute = f"_saker_{name}"
    value = getattr(tokenizer, attribute, None)
    if value is None:
        value = make()
        try:
            setattr(tokenizer, attribute, value)
        except AttributeError:
            pass
    return value


def fast_decode(tokenizer: Decoder) -> Callable[..., str]:
    """``decode(ids, skip_special_tokens=...)`` with the same result as ``tokenizer.decode``, straight from the
    Rust tokenizer when transformers' wrapper would add nothing to it (no clean-up of tokenization spaces, which
    transformers skips for BPE models anyway); the wrapper otherwise. Looked up once per tokenizer."""
    return tokenizer_memo(tokenizer, "fast_decode", lambda: _fast_decode(tokenizer))


def _fast_decode(tokenizer: Decoder) -> Callable[..., str]:
    decode = tokenizer.decode
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        clean = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        is_bpe = type(getattr(backend, "model", None)).__name__ == "BPE"
        if not clean or (is_bpe and not forced):
            decode = backend.decode
    return decode


def piece_texts(tokenizer: Decoder, skip_special_tokens: bool) -> dict[int, str] | None:
    """Each token's text decoded alone, filled as tokens come, for tokenizers whose decoder is GPT-2's byte-level
    one and nothing else: there, after text that ends on a whole character, a token adds exactly its own text
    (its bytes appended to complete UTF-8). None for other tokenizers (sentencepiece decoders strip or add
    spaces by position; decoder chains may rewrite text)."""

    def make() -> dict:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            import json

            decoder = json.loads(backend.to_str()).get("decoder") or {}
            if decoder.get("type") == "ByteLevel":
                return {True: {}, False: {}}
        return {}

    return tokenizer_memo(tokenizer, "pieces", make).get(skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, ids: Sequence[int] = (), skip_special_tokens: bool = True):
        """``ids`` are already-read tokens (the prompt): their text counts as released."""
        self.tokenizer = tokenizer
        self._decode_ids = fast_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - CONTEXT_TOKENS)
        self._prefix: tuple[tuple[int, int], str] | None = None
        self._pieces = piece_texts(tokenizer, skip_special_tokens)
        self._whole: bool | None = None  # released text ends on a whole character (None: not known)

    def _alone(self, token_id: int) -> str | None:
        """The text ``token_id`` adds, from the piece table, when that is exact: a byte-level tokenizer, nothing
        held back and the released text ending on a whole character. Then the token adds its own text: "" for a
        skipped special token, text ending in U+FFFD for an incomplete character. None: not known this way (the
        general path decides)."""
        if self._pieces is None or self.read_offset != len(self.ids):
            return None
        if self._whole is None:
            self._whole = not self._prefix_text().endswith(REPLACEMENT)
        if not self._whole:
            return None
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self._decode([token_id])
        return text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def _prefix_text(self) -> str:
        """Text of ``ids[prefix_offset:read_offset]``, decoded once per pair of offsets (the ids only grow, so
        the slice does not change until an offset moves): every candidate of a step shares it."""
        offsets = (self.prefix_offset, self.read_offset)
        if self._prefix is None or self._prefix[0] != offsets:
            self._prefix = (offsets, self._decode(self.ids[self.prefix_offset : self.read_offset]))
        return self._prefix[1]

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        alone = self._alone(token_id)
        if alone and not alone.endswith(REPLACEMENT):
            self.ids.append(token_id)
            self.prefix_offset = max(self.read_offset, len(self.ids) - CONTEXT_TOKENS)
            self.read_offset = len(self.ids)
            return alone
        self.ids.append(token_id)
        prefix_text = self._prefix_text()
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = self._new_part(prefix_text, new_text, self.ids[self.read_offset :])
            self.prefix_offset = max(self.read_offset, len(self.ids) - CONTEXT_TOKENS)
            self.read_offset = len(self.ids)
            self._whole = True
            return delta
        return ""

    def flush(self) -> str:
        """At the end: release what is held back (an incomplete character becomes U+FFFD, as the model made it)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._prefix_text()
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = self._new_part(prefix_text, new_text, self.ids[self.read_offset :])
        self.read_offset = len(self.ids)
        self._whole = None
        return delta

    def _new_part(self, prefix_text: str, new_text: str, new_ids: Sequence[int]) -> str:
        if new_text.startswith(prefix_text):
            return new_text[len(prefix_text) :]
        # a stray byte re-read the released byte run as U+FFFD: keep what is out, read the new ids alone
        return self._decode(new_ids)

    def candidate_texts(self, token_ids: Sequence[int]) -> list[str | None]:
        """``candidate_text`` of each id: straight from the piece table when the position allows it (one lookup
        per id, the common case of a byte-level tokenizer), otherwise id by id."""
        pieces = self._pieces
        clean = pieces is not None and self.read_offset == len(self.ids)
        if token_ids and clean and self._alone(token_ids[0]) is not None:
            texts = [pieces.get(token_id) for token_id in token_ids]
            if None in texts:
                texts = [self._alone(token_id) for token_id in token_ids]
            return [None if text.endswith(REPLACEMENT) else text for text in texts]
        return [self.candidate_text(token_id) for token_id in token_ids]

    def candidate_text(self, token_id: int) -> str | None:
        """Text ``token_id`` would add after the current ids; None when it would leave a character incomplete."""
        alone = self._alone(token_id)
        if alone is not None:
            return None if alone.endswith(REPLACEMENT) else alone
        prefix_text = self._prefix_text()
        new_text = self._decode(self.ids[self.prefix_offset :] + [token_id])
        if new_text.endswith(REPLACEMENT):
            return None
        return self._new_part(prefix_text, new_text, self.ids[self.read_offset :] + [token_id])

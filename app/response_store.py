"""The Responses API's store: responses kept for ``GET /v1/responses/{id}`` and ``previous_response_id``, bounded
in count and bytes, least recently used first out, per worker process (``SAKER_RESPONSES_STORE_ITEMS``,
``SAKER_RESPONSES_STORE_BYTES``). Nothing is written to disk; a restart forgets everything."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    response: dict  # the response object as it was answered
    messages: list[dict]  # the conversation as chat messages (input and output, instructions aside)
    size: int  # bytes it counts against the store's limit


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> bool:
        """Keep a response (evicting the least recently used as needed); False when it is larger than the
        whole store."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        if self.max_items <= 0 or size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(response["id"], None)
            if old is not None:
                self._bytes -= old.size
            self._items[response["id"]] = StoredResponse(response, messages, size)
            self._bytes += size
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                _, gone = self._items.popitem(last=False)
                self._bytes -= gone.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self._bytes -= item.size
            return item is not None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

"""The running batch: where the rows of the requests being decoded live between steps.

``SlotBatch`` keeps every candidate row in a slot of a preallocated KV store (``kv_cache.SlotStore``): joining
and leaving move no other row's data, and a step runs over slots ``[0, high)`` (eager) or over a bucket of slots
(``bucket``; the compiled step). ``PaddedBatch`` is the fallback for models whose cache cannot be kept in slots
(sliding windows, ...): rows left-padded to the longest. ``new_batch`` picks one for a model. What happens at each
step (admission, sampling, stopping) is in ``generate``.
"""

from __future__ import annotations


import torch

from app.engine.kv_cache import SlotStore, mergeable
from app.engine.runner import MIXED, ModelRunner
from app.engine.sampler import SamplingRows


from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: generate imports this module
    from app.engine.generate import RequestGroup


def new_batch(runner: ModelRunner, kv_cache_tokens: int | None = None) -> "SlotBatch | PaddedBatch":
    """A slot batch where the model's cache layers are plain (their rows can be written into slots), else a
    left-padded one."""
    return SlotBatch(runner, kv_cache_tokens) if runner.plain_cache else PaddedBatch(runner)


class BatchOutOfMemory(Exception):
    """A decode forward of a batch of several groups ran out of memory. The batch was rewound to how it was
    before the step (each layer's cache back to its length, the mask without the new column), so the step can
    be retried once a group has left. ``error`` is the original ``torch.OutOfMemoryError``."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class BatchBase:
    """What both kinds of running batch share: their groups (rows in group order) and the adapters in use."""

    runner: ModelRunner
    groups: list[RequestGroup]

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def adapters(self) -> set[str | None]:
        return {g.params.adapter for g in self.groups}

    @property
    def adapter(self) -> object:
        """The PEFT adapter every row uses (None: the base model), or ``MIXED``."""
        if not self.runner.adapters:
            return None
        adapters = self.adapters
        return (adapters.pop() if adapters else None) if len(adapters) <= 1 else MIXED


class SlotBatch(BatchBase):
    """The running batch over a ``SlotStore``: each candidate row owns a slot of preallocated keys and values.

    A group joins after its prefill (its prompt's keys and values are written into its rows' slots) and leaves
    when its last candidate finishes (the slots are free at once); no other row's data moves. A step feeds every
    slot in ``[0, high)`` its next token at its own position, with a mask built from per-slot lengths (free slots
    in between run along and are ignored), then takes the active rows' logits in row order."""

    joinable = True

    def __init__(self, runner: ModelRunner, kv_cache_tokens: int | None = None):
        self.runner = runner
        self.groups: list[RequestGroup] = []
        self.store = SlotStore(kv_cache_tokens)
        self.slot_of: list[int] = []  # slot of each row, in row order
        self.lengths_host: list[int] = []  # tokens each row has in its slot (row order)
        self._slot_index: torch.Tensor | None = None
        self._in_order = False  # rows sit in slots 0..n-1 in order (logits need no gather)
        self.lengths: torch.Tensor | None = None  # per slot: tokens in the slot (= position fed next)
        self.next_tokens: torch.Tensor | None = None  # per slot: the token fed next
        self.sampling: SamplingRows | None = None  # every row's sampling parameters and history
        self.reserved: dict[int, int] = {}  # slot -> prompt length: prompts being prefilled into their slot
        self._like = None  # a one-token cache: what a position of this model's keys and values looks like

    @property
    def cache(self):
        return self.store.cache

    def _live(self) -> int:
        """Positions the longest row or reserved prompt holds, plus the one it writes next (a resize keeps them)."""
        return max([*self.lengths_host, *self.reserved.values()], default=0) + 1

    def reserve(self, prompt: list[int], cached: list | None = None) -> int:
        """A slot for a prompt prefilled in chunks by the batch's steps (``forward_with_chunks``), with room for the
        whole prompt and its first token; ``cached``: per layer (keys, values) of its first positions (the prefix
        cache's), written into the slot now. Until the prompt's rows join, steps without a chunk leave the slot's
        prompt alone (they write at its length, a position no chunk writes)."""
        if self._like is None:
            self._like = self.runner.probe_cache()
        [slot] = self.store.allocate(1)
        self.reserved[slot] = len(prompt)
        self.store.ensure(
            len(prompt) + 1, [(layer.keys, layer.values) for layer in self._like.layers], live=self._live()
        )
        if cached:
            self.store.write([slot], [_Layer(k, v) for k, v in cached], live=self._live())
        device = self.store.layers[0].keys.device
        self._per_slot(device)
        self.lengths[slot] = len(prompt)
        return slot

    def unreserve(self, slot: int) -> None:
        """A prompt being prefilled left (its client went away, or it failed): its slot is free."""
        if self.reserved.pop(slot, None) is not None:
            self.store.release([slot])
            self.lengths[slot] = 0
            self._reset_if_idle()

    def prompt_layers(self, slot: int, length: int) -> list:
        """A reserved slot's prompt as cache layers (views; ``PrefixCache.store`` copies them)."""
        return [
            _Layer(layer.keys[slot : slot + 1, :, :length], layer.values[slot : slot + 1, :, :length])
            for layer in self.store.layers
        ]

    def accepts(self, group: RequestGroup) -> bool:
        return not self.groups or self.runner.can_join(self.adapters, group.params.adapter)

    def _per_slot(self, device) -> None:
        """Per-slot tensors as long as the store's slots (grown with it)."""
        size = self.store.wanted
        if self.lengths is None or self.lengths.shape[0] < size:
            lengths = torch.zeros(size, dtype=torch.long, device=device)
            tokens = torch.zeros(size, dtype=torch.long, device=device)
            if self.lengths is not None:
                lengths[: self.lengths.shape[0]] = self.lengths
                tokens[: self.next_tokens.shape[0]] = self.next_tokens
            self.lengths, self.next_tokens = lengths, tokens

    def add(self, group: RequestGroup, cache, tokens: torch.Tensor, sampling: SamplingRows) -> None:
        """Join a prefilled group: its cache (one row, or one per candidate), its candidates' first tokens,
        their sampling state."""
        slots = self.store.allocate(group.rows)
        length = self.store.write(slots, cache.layers, live=self._live())
        self._join(group, slots, length, tokens, sampling)

    def add_reserved(self, group: RequestGroup, slot: int, tokens: torch.Tensor, sampling: SamplingRows) -> None:
        """Join a group whose prompt was prefilled into reserved ``slot``: its first row keeps that slot, each
        other candidate gets a slot of its own with a copy of the prompt's keys and values."""
        length = self.reserved.pop(slot)
        slots = [slot] + self.store.allocate(group.rows - 1)
        if len(slots) > 1:
            self.store.write(slots[1:], self.prompt_layers(slot, length), live=self._live())
        self._join(group, slots, length, tokens, sampling)

    def _join(self, group: RequestGroup, slots: list[int], length: int, tokens: torch.Tensor, sampling) -> None:
        self._per_slot(tokens.device)
        index = torch.tensor(slots, dtype=torch.long, device=tokens.device)
        self.lengths[index] = length
        self.next_tokens[index] = tokens
        self.groups.append(group)
        self.slot_of += slots
        self.lengths_host += [length] * group.rows
        self._slot_index = None
        self.sampling = sampling if self.sampling is None else SamplingRows.cat([self.sampling, sampling])

    def _reset_if_idle(self) -> bool:
        """No rows and no reserved prompt: the storage goes back (a compiled step keeps it: its graphs hold the
        addresses). Whether it did."""
        if self.slot_of or self.reserved or self.runner.compiled_step is not None:
            return False
        self.store.reset()
        self.lengths = self.next_tokens = None
        self.slot_of, self.lengths_host, self._slot_index, self.sampling = [], [], None, None
        return True

    @property
    def slot_index(self) -> torch.Tensor:
        if self._slot_index is None:
            self._slot_index = torch.tensor(self.slot_of, dtype=torch.long, device=self.lengths.device)
            self._in_order = self.slot_of == list(range(len(self.slot_of)))
        return self._slot_index

    def keep(self, keep_rows: list[int], tokens: torch.Tensor | None) -> None:
        """After a step: the rows' next tokens (row order), then only ``keep_rows`` stay; the others' slots are
        free."""
        if tokens is not None and self.slot_of:
            self.next_tokens[self.slot_index] = tokens
        self.groups = [g for g in self.groups if g.rows]
        if len(keep_rows) == len(self.slot_of):
            return
        kept = set(keep_rows)
        gone = [slot for row, slot in enumerate(self.slot_of) if row not in kept]
        self.store.release(gone)
        if not keep_rows:
            self.slot_of, self.lengths_host, self._slot_index, self.sampling = [], [], None, None
            if self._reset_if_idle():
                return
        self.lengths[torch.tensor(gone, dtype=torch.long, device=self.lengths.device)] = 0
        self.slot_of = [self.slot_of[r] for r in keep_rows]
        self.lengths_host = [self.lengths_host[r] for r in keep_rows]
        self._slot_index = None
        self.sampling = self.sampling.select(keep_rows) if keep_rows else None

    def forward(self) -> torch.Tensor:
        """One decode step for every row; float32 logits (B, V) in row order. A forward that runs out of memory
        with several groups in the batch raises ``BatchOutOfMemory``: nothing moved (lengths advance only after
        a step), so the step can be retried once a group has left.

        Eager, the step runs over slots ``[0, high)`` with a window just past the longest row. Compiled
        (SAKER_COMPILE), it runs over a bucket of slots (free slots pad it) and, on the CPU, a window bucket
        (``window``: 256, 512, ... positions, up to the capacity; on CUDA the whole capacity), so that the shapes
        come from a fixed set whatever rows join and leave, each warmed up at start (``warm_up``)."""
        store, runner = self.store, self.runner
        longest = max(self.lengths_host) + 1
        mixed = self.adapter is MIXED
        compiled = runner.compiled_step if not mixed else None
        if compiled is not None:
            rows = bucket(store.high)
            store.ensure(longest, slots=rows)
            # CUDA graphs keep the whole capacity (one recorded graph per bucket: windowed ones failed in the server
            # on an H100, see docs/performance.md); the CPU takes the smallest window that holds the rows
            view = store.capacity if store.static else window(longest, store.capacity)
        else:
            rows = store.high
            store.ensure(longest)
            view = min(store.capacity, -(-longest // 16) * 16)
        self._per_slot(self.lengths.device)
        names = None
        if mixed:
            names = ["__base__"] * rows
            row = 0
            for group in self.groups:
                for _ in range(group.rows):
                    names[self.slot_of[row]] = group.params.adapter or "__base__"
                    row += 1
        try:
            forward = compiled or runner.slot_step
            logits = forward(
                self.next_tokens[:rows],
                self.lengths[:rows],
                store,
                view,
                **({"adapter_names": names} if names is not None else {}),
            )
        except torch.OutOfMemoryError as exc:
            if len(self.groups) < 2:
                raise
            raise BatchOutOfMemory(exc) from None
        index = self.slot_index
        self.lengths[index] += 1
        self.lengths_host = [n + 1 for n in self.lengths_host]
        if rows == len(self.slot_of) and self._in_order:
            return logits
        return logits.index_select(0, index)

    def forward_with_chunks(
        self, chunks: list[tuple[int, list[int], int, str]], with_rows: bool = True
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """One flat forward (``attention.FlatStep``) for every row's next token (``with_rows``) and chunks of
        prompts being prefilled into reserved slots, each ``(slot, ids, start, logits)``: the prompts ride in the
        decode step instead of stalling it in forwards of their own. Returns the rows' float32 logits (rows, V) in
        row order (None without rows) and each chunk's: at each of its positions (``logits == "all"``: prompt
        scoring), at its last only (``"last"``: it ends the prompt), or none (``"none"``)."""
        from app.engine.attention import FlatStep

        device = self.store.layers[0].keys.device
        rows = len(self.slot_of) if with_rows else 0
        ids, at, slots, wanted, spans, view = [], [], [], [], [], 0
        if rows:
            index = self.slot_index
            ids, at, slots = [self.next_tokens[index]], [self.lengths[index]], [index]
            view = min(self.store.capacity, -(-(max(self.lengths_host) + 1) // 16) * 16)
        offset = rows
        for slot, chunk, start, logits in chunks:
            count = len(chunk)
            ids.append(torch.tensor(chunk, dtype=torch.long, device=device))
            at.append(torch.arange(start, start + count, dtype=torch.long, device=device))
            slots.append(torch.full((count,), slot, dtype=torch.long, device=device))
            keep = {"all": range(offset, offset + count), "last": range(offset + count - 1, offset + count)}
            positions = keep.get(logits, range(0))
            spans.append((len(wanted) + rows, len(wanted) + rows + len(positions)))
            wanted += positions
            offset += count
        logits_at = torch.tensor([*range(rows), *wanted], dtype=torch.long, device=device)
        flat = FlatStep(
            self.store,
            torch.cat(slots),
            torch.cat(at),
            rows,
            view,
            tuple((slot, start, len(chunk)) for slot, chunk, start, _ in chunks),
        )
        try:
            logits = self.runner.flat_step(torch.cat(ids), flat, logits_at)
        except torch.OutOfMemoryError as exc:
            if not rows:
                raise
            raise BatchOutOfMemory(exc) from None  # the newest prompt fails first, then the step is retried
        per_chunk = [logits[a:b] for a, b in spans]
        if not rows:
            return None, per_chunk
        index = self.slot_index
        self.lengths[index] += 1
        self.lengths_host = [n + 1 for n in self.lengths_host]
        return logits[:rows], per_chunk

    def warm_up(self, like, max_rows: int, length: int) -> None:
        """Compiled steps: storage for the largest bucket at ``length`` positions, then one step per batch bucket
        up to ``max_rows`` (on the CPU, per window as well) over free slots, so that no request pays a compile or
        a graph capture (torch.compile makes the rows and the window dynamic at their second value: a few graphs
        in all). On CUDA the window is the whole capacity and each bucket is one recorded CUDA graph."""
        top = bucket(max_rows)
        device = like.layers[0].keys.device
        self.store.static = device.type == "cuda"
        self.store.ensure(length, like=[(layer.keys, layer.values) for layer in like.layers], slots=top)
        for rows in BUCKETS + tuple(range(BUCKETS[-1] + 8, top + 1, 8)):
            if rows > top:
                break
            zeros = torch.zeros(rows, dtype=torch.long, device=device)
            for view in (self.store.capacity,) if self.store.static else windows(self.store.capacity):
                self.runner.compiled_step(zeros, zeros.clone(), self.store, view)


BUCKETS = (1, 2, 4, 8, 16, 24, 32)
WINDOW_MIN = 256  # the smallest attention window of a compiled step; the windows double up to the capacity


def windows(capacity: int) -> tuple[int, ...]:
    """The attention windows a compiled step runs with: 256, 512, ... below ``capacity``, then ``capacity``."""
    out, size = [], WINDOW_MIN
    while size < capacity:
        out.append(size)
        size *= 2
    return (*out, capacity)


def window(longest: int, capacity: int) -> int:
    """The smallest window that holds ``longest`` positions. A compiled step attends over its window rather than
    the whole slot capacity (8,192 positions for SmolLM2): on the CPU a 512-position window made the embedded
    model's step 13.6-14.1 ms against 18-20 eager, where the whole capacity made it 220 ms."""
    size = WINDOW_MIN
    while size < longest:
        size *= 2
    return min(size, capacity)


def bucket(rows: int) -> int:
    """Batch sizes a compiled step is captured for: 1, 2, 4, 8, 16, 24, 32, then multiples of 8."""
    for size in BUCKETS:
        if rows <= size:
            return size
    return -(-rows // 8) * 8


class PaddedBatch(BatchBase):
    """The running batch for models whose cache layers cannot be written per slot (sliding windows, static
    caches): one KV cache for the rows of several groups, left-padded to a common length.

    Each row keeps its own positions; an attention mask hides the padding. A group joins after its prefill
    and leaves when its last candidate finishes; one forward per step serves every row."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.groups: list[RequestGroup] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # (B, L) 1 = real token, 0 = padding; None: no padding
        self.positions: torch.Tensor | None = None  # (B,) position of the token fed next
        self.tokens: torch.Tensor | None = None  # (B,) token fed next
        self.sampling: SamplingRows | None = None  # every row's sampling parameters and history
        self.length = 0  # cached columns

    @property
    def joinable(self) -> bool:
        return mergeable(self.cache)

    def accepts(self, group: RequestGroup) -> bool:
        if not self.groups:
            return True
        return self.runner.can_join(self.adapters, group.params.adapter) and mergeable(self.cache)

    def add(self, group: RequestGroup, cache, tokens: torch.Tensor, sampling: SamplingRows) -> None:
        """Join a prefilled group: its cache (rows, prompt length), its first chosen tokens, its rows'
        sampling state."""
        if group.rows > 1 and cache.layers[0].keys.shape[0] == 1:
            cache.batch_repeat_interleave(group.rows)
        length = len(group.prompt_ids)
        device = tokens.device
        positions = torch.full((group.rows,), length, dtype=torch.long, device=device)
        if not self.groups:
            self.groups, self.cache, self.mask = [group], cache, None
            self.positions, self.tokens, self.length = positions, tokens, length
            self.sampling = sampling
            return
        self.sampling = SamplingRows.cat([self.sampling, sampling])
        new_len = max(self.length, length)
        old_mask = (
            self.mask if self.mask is not None else torch.ones(self.rows, self.length, dtype=torch.long, device=device)
        )
        grp_mask = torch.ones(group.rows, length, dtype=torch.long, device=device)
        for layer, new_layer in zip(self.cache.layers, cache.layers):
            layer.keys = torch.cat([_left_pad(layer.keys, new_len), _left_pad(new_layer.keys, new_len)])
            layer.values = torch.cat([_left_pad(layer.values, new_len), _left_pad(new_layer.values, new_len)])
        self.mask = torch.cat([_left_pad(old_mask, new_len, dim=1), _left_pad(grp_mask, new_len, dim=1)])
        self.positions = torch.cat([self.positions, positions])
        self.tokens = torch.cat([self.tokens, tokens])
        self.length = new_len
        self.groups.append(group)

    def keep(self, keep_rows: list[int], tokens: torch.Tensor | None) -> None:
        """After a step: keep these batch rows (their next tokens are ``tokens`` rows; None: as they are) and
        drop the rest."""
        if tokens is None:
            tokens = self.tokens
        self.groups = [g for g in self.groups if g.rows]
        if not keep_rows:
            self.groups, self.cache, self.mask, self.positions, self.tokens, self.length = [], None, None, None, None, 0
            self.sampling = None
            return
        if len(keep_rows) == tokens.shape[0]:
            self.tokens = tokens
            return
        self.sampling = self.sampling.select(keep_rows)
        index = torch.tensor(keep_rows, device=tokens.device)
        self.tokens = tokens.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.cache.batch_select_indices(index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            self._trim()

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row (a long prompt left the batch)."""
        leading = int((self.mask.cumsum(1) == 0).sum(1).min())
        if leading:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, leading:]
                layer.values = layer.values[:, :, leading:]
            self.mask = self.mask[:, leading:]
            self.length -= leading
        if bool(self.mask.all()):
            self.mask = None

    def forward(self) -> torch.Tensor:
        """One decode step for every row; float32 logits (B, V). Raises ``BatchOutOfMemory`` (the batch as
        before the step) when the forward of a batch of several mergeable groups runs out of memory."""
        length_before, mask_before = self.length, self.mask
        mask = None
        if self.mask is not None:
            self.mask = torch.cat(
                [self.mask, torch.ones(self.rows, 1, dtype=self.mask.dtype, device=self.mask.device)], dim=1
            )
            mask = self.mask
        row_adapters = None
        if self.adapter is MIXED:
            row_adapters = [g.params.adapter for g in self.groups for _ in range(g.rows)]
        try:
            logits = self.runner.decode(
                self.tokens, self.cache, attention_mask=mask, position_ids=self.positions, row_adapters=row_adapters
            )
        except torch.OutOfMemoryError as exc:
            if len(self.groups) < 2 or not mergeable(self.cache):
                raise
            self._rewind(length_before, mask_before)
            raise BatchOutOfMemory(exc) from None
        self.positions = self.positions + 1
        self.length += 1
        return logits

    def _rewind(self, length: int, mask: torch.Tensor | None) -> None:
        """Undo a failed step: layers that appended the step's token go back to ``length`` columns (views of
        the same buffers), and the mask loses the column the step added."""
        self.mask = mask
        for layer in self.cache.layers:
            if layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


def _left_pad(tensor: torch.Tensor, length: int, dim: int = -2) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=tensor.dtype, device=tensor.device), tensor], dim=dim)


class _Layer:
    """One layer's keys and values shaped as a cache layer's (what ``SlotStore.write`` and ``PrefixCache.store``
    read)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

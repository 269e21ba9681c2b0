"""The running batch: where the rows of the requests being decoded live between steps.

``BlockBatch`` keeps every candidate row as a sequence of blocks of the KV pool (``kv_cache.KVPool``, bookkept by
``blocks.BlockManager``, which also keeps the prefix cache): joining and leaving move no other row's data, and a
step attends over each row's own blocks, as many as its length needs (eager) or a window bucket (``bucket``,
``window``; the compiled step). What happens at each step (admission, sampling, stopping) is in ``generate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from app.engine.model.attention import Scratch
from app.engine.core.blocks import BLOCK, BlockManager
from app.engine.model.shapes import BUCKETS, bucket, window, windows
from app.engine.model.kv_cache import KVPool
from app.engine.model.runner import MIXED, ModelRunner
from app.engine.sampling.sampler import SamplingRows

if TYPE_CHECKING:  # a type only: sequence's module imports what imports this one
    from app.engine.core.sequence import RequestGroup, Sequence


class BatchOutOfMemory(Exception):
    """A decode forward of a batch of several groups ran out of memory. Nothing moved (lengths advance only after a
    step), so the step can be retried once a group has left. ``error`` is the original ``torch.OutOfMemoryError``."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class BlockBatch:
    """The running batch over the block pool (``kv_cache.KVPool``, bookkept by ``blocks.BlockManager``): each
    candidate row is a sequence with its own block table; rows are kept in row order (tables, lengths and next
    tokens in preallocated arrays), so joining and leaving move no KV.

    A prompt is computed by the batch's steps into blocks reserved for it (``reserve``: the leading full blocks a
    cached prompt shares come from the prefix cache, no KV is copied), then its group joins (``add_reserved``): the
    first candidate keeps the prompt's blocks, each other one shares its full blocks and copies only the last,
    partial one. A step (``forward``, ``forward_with_chunks``) feeds every row its next token at its own position;
    a row gets a new block when it crosses into one."""

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

    def __init__(self, runner: ModelRunner, kv_cache_tokens: int | None = None, prefix_cache_tokens: int = 0):
        self.runner = runner
        self.groups: list[RequestGroup] = []
        self.kv_cache_tokens = kv_cache_tokens  # the KV budget in positions (None: the default, at the first use)
        self.budget = 0  # the budget in use (set with the pool)
        self.blocks = BlockManager(0, prefix_cache_tokens // BLOCK)
        self.pool: KVPool | None = None
        self.static = False  # compiled on CUDA: the pool never moves (set by ``warm_up``)
        self.capacity = 0  # compiled: the longest window a step attends over (set by ``warm_up``)
        self.top_rows = 0  # compiled: the widest bucket warmed up (a wider step runs eagerly)
        self.n = 0  # rows
        self.tables = np.zeros((0, 0), dtype=np.int64)  # per row: its blocks in order, 0 (the null block) after
        self.counts = np.zeros(0, dtype=np.int64)  # per row: blocks in its table
        self.lengths = np.zeros(0, dtype=np.int64)  # per row: positions it holds (= the position fed next)
        self.chains = np.zeros(0, dtype=np.int64)  # per row: the hash of its last full block's prefix-cache key
        # per row: its sequence, whose ``block_table`` and ``num_computed_tokens`` the arrays above mirror
        self.seqs: list[Sequence] = []
        self.next_tokens: torch.Tensor | None = None  # per row: the token fed next
        self.sampling: SamplingRows | None = None  # every row's sampling parameters and history
        self.prompts = 0  # prompts holding blocks while they are prefilled
        self.scratch = Scratch()  # the buffers steps read blocks into (given back with the pool)
        self.parked: dict[int, tuple[torch.Tensor, SamplingRows]] = {}  # preempted groups' rows, by arrival
        self.speculation = None  # SAKER_SPECULATIVE: ``speculative.Speculation`` (None: off)

    # -- blocks ---------------------------------------------------------------------------------------------------
    def make_pool(self) -> int:
        """Allocate the pool now (else at the first step); its budget in positions."""
        self._pool()
        return self.budget

    def _pool(self) -> KVPool:
        if self.pool is None:
            self.budget = self.kv_cache_tokens or self.runner.default_kv_budget()
            self.blocks.num_blocks = -(-self.budget // BLOCK) + 1  # and the null block
            self.pool = KVPool(self.runner.probe_cache(), self.blocks.num_blocks, self.static, self.runner.kv_dtype)
        return self.pool

    def _allocate(self, count: int) -> list[int]:
        pool = self._pool()
        out = self.blocks.allocate(count) if count > 0 else []
        pool.touch(self.blocks.fresh)
        return out

    def _room(self, rows: int, columns: int) -> None:
        """Arrays for at least ``rows`` rows of ``columns`` blocks (grown, doubling; the new part zero)."""
        have_rows, have_columns = self.tables.shape
        if rows <= have_rows and columns <= have_columns:
            return
        rows, columns = (
            max(rows, 2 * have_rows, 8),
            max(columns, have_columns if columns <= have_columns else 2 * have_columns, 16),
        )
        tables = np.zeros((rows, columns), dtype=np.int64)
        tables[:have_rows, :have_columns] = self.tables
        counts, lengths, chains = (np.zeros(rows, dtype=np.int64) for _ in range(3))
        counts[: self.counts.shape[0]], lengths[: self.lengths.shape[0]] = self.counts, self.lengths
        chains[: self.chains.shape[0]] = self.chains
        self.tables, self.counts, self.lengths, self.chains = tables, counts, lengths, chains

    def reserve(self, prompt: list[int], salt: object, reuse: bool) -> tuple[list[int], list, int]:
        """Blocks for a prompt computed by the batch's steps: ``(table, keys, cached)``, its block table (the
        leading full blocks a kept prompt shares, when ``reuse``, then fresh ones for the rest), the chained keys of
        its full blocks (to ``register`` them once computed) and how many of its positions are cached (at least one
        is always computed: its logits pick the first token)."""
        self._pool()
        keys = self.blocks.keys(prompt, salt) if self.blocks.cached_limit else []
        found = self.blocks.lookup(keys[: (len(prompt) - 1) // BLOCK], len(prompt)) if reuse else []
        try:
            table = found + self._allocate(-(-len(prompt) // BLOCK) - len(found))
        except BaseException:
            self.blocks.release(found)
            raise
        self.prompts += 1
        return table, keys, len(found) * BLOCK

    def register(self, table: list[int], keys: list, start: int, end: int) -> None:
        """The full blocks among positions ``[start, end)`` of a prompt are computed: later prompts may share them."""
        for i in range(start // BLOCK, min(end // BLOCK, len(keys))):
            self.blocks.register(table[i], keys[i])

    def unreserve(self, table: list[int], spare: list[int] = ()) -> None:
        """A prompt being prefilled left (its client went away, it failed, or it ended on its first tokens): its
        blocks are let go, and the ``spare`` ones reserved for its other candidates' copies with them (before the
        pool may be compacted: nothing may be held then)."""
        self.blocks.release(list(spare))
        self.blocks.release(table)
        self.prompts -= 1
        self._when_idle()

    def spare_blocks(self, group: RequestGroup) -> list[int]:
        """Blocks for the copies of a prompt's partial last block that its other candidates take when it joins,
        reserved with the prompt (so that joining never waits for blocks)."""
        count = (group.params.num_candidates - 1) * (len(group.prompt_ids) % BLOCK > 0)
        return self._allocate(count) if count and group.generates else []

    def add_reserved(
        self,
        group: RequestGroup,
        table: list[int],
        tokens: torch.Tensor,
        sampling: SamplingRows,
        chain: int = 0,
        spare: list[int] = (),
    ) -> None:
        """Join a group whose prompt was computed into ``table``: its first row keeps those blocks, each other
        candidate shares the full ones and gets a copy of the last, partial one (into a ``spare`` block, or a new
        one). ``chain``: the hash of the prompt's last full block's key, which the blocks its rows fill next are
        chained to (``_register_filled``). Each running candidate's ``block_table`` is its row's."""
        length = len(group.prompt_ids)
        full, partial = length // BLOCK, length % BLOCK
        spare = list(spare)
        tables = [table]
        for _ in range(group.rows - 1):
            self.blocks.share(table[:full])
            own = []
            if partial:
                own = [spare.pop()] if spare else self._allocate(1)
                self.pool.copy_block(table[full], own[0])
            tables.append(table[:full] + own)
        self.blocks.release(spare)  # candidates that ended on their first token
        for seq in group.seqs:
            seq.block_table = []
        for seq, own in zip(group.running, tables):
            seq.block_table = own
        self.add_rows(group, [chain] * group.rows, tokens, sampling, prompts=1)

    def add_rows(
        self,
        group: RequestGroup,
        chains: list[int],
        tokens: torch.Tensor,
        sampling: SamplingRows,
        prompts: int,
    ) -> None:
        """Join a group's rows (its running sequences, each on its own blocks: the tables ``prompts`` reservations
        made, holding ``num_computed_tokens`` positions), with their next tokens and sampling state: after a prompt
        (``add_reserved``), or a preempted group whose rows were computed again (``ChunkedPrefill``)."""
        self.prompts -= prompts
        seqs = list(group.running)
        tables, lengths = [seq.block_table for seq in seqs], [seq.num_computed_tokens for seq in seqs]
        rows = len(tables)
        self._room(self.n + rows, max(len(t) for t in tables))
        for i, t in enumerate(tables):
            self.tables[self.n + i, : len(t)] = t
            self.counts[self.n + i] = len(t)
        self.lengths[self.n : self.n + rows] = lengths
        self.chains[self.n : self.n + rows] = chains
        self.n += rows
        self.seqs += seqs
        self.groups.append(group)
        self.next_tokens = tokens if self.next_tokens is None else torch.cat([self.next_tokens, tokens])
        self.sampling = sampling if self.sampling is None else SamplingRows.cat([self.sampling, sampling])

    def mirror_problem(self) -> str | None:
        """Whether the arrays mirror the rows' sequences, in words (None: they do): one sequence per row, in the
        groups' order, each row's table its sequence's ``block_table`` and its length the sequence's
        ``num_computed_tokens``. Holds between steps and before a forward (a forward advances the lengths at once,
        the sequences when their tokens are settled)."""
        running = [seq for group in self.groups for seq in group.running]
        if len(self.seqs) != self.n or len(running) != self.n or any(a is not b for a, b in zip(self.seqs, running)):
            return f"{len(self.seqs)} sequences for {self.n} rows ({len(running)} running), or not in the groups' order"
        for row, seq in enumerate(self.seqs):
            table = self.tables[row, : self.counts[row]].tolist()
            if seq.block_table != table or seq.num_computed_tokens != int(self.lengths[row]):
                return (
                    f"row {row}: table {table} / {int(self.lengths[row])} positions, its sequence's "
                    f"{seq.block_table} / {seq.num_computed_tokens}"
                )
        return None

    def free_blocks(self) -> int:
        """Blocks the pool can hand out now (cached ones with no holder included)."""
        self._pool()
        return self.blocks.free_blocks

    def blocks_wanted(self) -> int:
        """Blocks the next decode step hands out: one to each row that crosses into a new block."""
        n = self.n
        return int(np.count_nonzero(self.lengths[:n] // BLOCK >= self.counts[:n]))

    def park(self, group: RequestGroup, tokens: torch.Tensor, sampling: SamplingRows) -> None:
        """A preempted group's rows' next tokens and sampling state (seeds' step counters, penalty history, grammar
        matchers), kept until its rows are computed again and join (``unpark``), by its arrival number."""
        self.parked[group.arrival] = (tokens, sampling)

    def unpark(self, group: RequestGroup) -> tuple[torch.Tensor, SamplingRows] | None:
        """What ``park`` kept for ``group`` (None: nothing), given back once."""
        return self.parked.pop(group.arrival, None)

    def rows_of(self, group: RequestGroup) -> list[int]:
        """The batch rows of ``group``'s candidates, in order."""
        start = 0
        for g in self.groups:
            if g is group:
                return list(range(start, start + g.rows))
            start += g.rows
        return []

    def keep(self, keep_rows: list[int], tokens: torch.Tensor | None) -> None:
        """After a step: the rows' next tokens (row order), then only ``keep_rows`` stay; the others' blocks are
        let go."""
        if tokens is not None and self.n:
            self.next_tokens = tokens
        self.groups = [g for g in self.groups if g.rows]
        n = self.n
        if len(keep_rows) == n:
            return
        kept = set(keep_rows)
        for row in range(n):
            if row not in kept:
                self.blocks.release(self.tables[row, : self.counts[row]].tolist())
                self.seqs[row].block_table = []
        self.seqs = [self.seqs[row] for row in keep_rows]
        index = np.asarray(keep_rows, dtype=np.int64)
        count = len(keep_rows)
        for array in (self.tables, self.counts, self.lengths, self.chains):
            array[:count] = array[index]
            array[count:n] = 0
        self.n = count
        if count:
            self.next_tokens = self.next_tokens.index_select(0, torch.from_numpy(index).to(self.next_tokens.device))
            self.sampling = self.sampling.select(keep_rows)
        else:
            self.next_tokens, self.sampling = None, None
            self._when_idle()

    def _when_idle(self) -> None:
        """No rows and no prompt being prefilled: once the blocks the pool has touched are well beyond those the
        prefix cache keeps, the pool's memory goes back (the cached blocks are copied to the front of a fresh pool).
        A small pool is kept as it is, with its read buffers (one request after another must not pay for a new one);
        a compiled step keeps its pool (its graphs hold the addresses)."""
        if self.n or self.prompts or self.blocks.held_blocks or self.pool is None:
            return  # (blocks held with no row and no prompt are a leak: the engine core's idle check finds it)
        if self.runner.compiled_step is not None:
            return
        if self.pool.touched > 2 * (self.blocks.cached_tokens // BLOCK) + IDLE_KEEP:
            self.scratch = Scratch()
            self.pool = self.pool.compacted(self.blocks.compact())

    def reset(self, free_memory: bool = True) -> None:
        """Drop every row, prompt and block (after a failed step): nothing is held or cached any more; the prefix
        cache's counters and the parked rows of preempted groups (they hold no blocks) stay. ``free_memory``: the
        pool goes too (made again at the next step), unless a compiled step's graphs hold its addresses."""
        self.groups, self.n, self.prompts = [], 0, 0
        for seq in self.seqs:
            seq.block_table = []
        self.seqs = []
        self.tables[:], self.counts[:], self.lengths[:], self.chains[:] = 0, 0, 0, 0
        self.next_tokens = self.sampling = None
        if free_memory and not self.static:
            self.pool, self.scratch = None, Scratch()
        self.blocks.reset()

    @property
    def kv_usage(self) -> float:
        """The positions of the blocks held by rows and prompts, as a share of the KV budget (0-1)."""
        if self.pool is None:
            return 0.0
        return min(1.0, self.blocks.held_blocks * BLOCK / self.budget)

    # -- steps ----------------------------------------------------------------------------------------------------
    def _rows_inputs(self, rows: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The decode rows' pool slots to write (rows,), the blocks each attends over (rows, width / BLOCK) and their
        positions, for ``rows`` rows (those past ``self.n`` are padding: the null block), after giving a block to each
        row that crosses into one."""
        self._room(rows, width // BLOCK)
        n = self.n
        lengths = self.lengths[:n]
        column = lengths // BLOCK
        for row in np.nonzero(column >= self.counts[:n])[0].tolist():  # a row starts a new block: 1 in 16 steps
            [block] = self._allocate(1)
            self.tables[row, column[row]] = block
            self.counts[row] += 1
            self.seqs[row].block_table.append(block)
        write = np.zeros(rows, dtype=np.int64)
        write[:n] = self.tables[np.arange(n), column] * BLOCK + lengths % BLOCK
        return write, self.tables[:rows, : width // BLOCK], self.lengths[:rows]

    def fit_guesses(self, guesses: list[list[int]]) -> list[list[int]]:
        """``guesses`` (row order) cut to the blocks the pool can hand out now: the step writes a row's guesses at
        its next positions, so a guess that would need more blocks than are free (beside those the rows' own next
        tokens take) is cut back to the blocks its row holds."""
        n = self.n
        free = self.free_blocks() - self.blocks_wanted()
        lengths, counts = self.lengths[:n], self.counts[:n]
        held = np.maximum(counts, lengths // BLOCK + 1)  # blocks each row has after its own next token
        out = []
        for row, guess in enumerate(guesses):
            more = int((lengths[row] + len(guess)) // BLOCK + 1 - held[row]) if guess else 0
            if more > free:
                guess = guess[: int(held[row] * BLOCK - 1 - lengths[row])]
                more = 0
            free -= more
            out.append(guess)
        return out

    def _guess_inputs(
        self, guesses: list[list[int]], device, rows: int = 0, width: int = 0
    ) -> tuple[torch.Tensor, np.ndarray, ...]:
        """The rows' tokens when rows carry guesses (``guesses``: row order, fitted by ``fit_guesses``): each row
        computes its next token and its guesses at its next positions, each token a query of its own. Returns the
        tokens (T,), their positions, their pool slots, and each token's row's blocks (T, blocks), after giving each
        row the blocks its tokens reach. ``rows``, ``width``: padded to that many queries (the null block's) and
        positions (a compiled step's bucket and window; 0: as many as needed)."""
        n = self.n
        extra = np.fromiter((len(g) for g in guesses), dtype=np.int64, count=n)
        need = (self.lengths[:n] + extra) // BLOCK + 1
        columns = width // BLOCK if width else int(need.max())
        self._room(n, columns)
        for row in np.nonzero(need > self.counts[:n])[0].tolist():
            fresh = self._allocate(int(need[row] - self.counts[row]))
            self.tables[row, self.counts[row] : need[row]] = fresh
            self.counts[row] = need[row]
            self.seqs[row].block_table += fresh
        per_row = extra + 1
        which = np.repeat(np.arange(n), per_row)
        count = which.size
        rows = max(rows, count)
        starts = np.cumsum(per_row) - per_row
        positions, write = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        positions[:count] = self.lengths[:n][which] + (np.arange(count) - starts[which])
        write[:count] = self.tables[which, positions[:count] // BLOCK] * BLOCK + positions[:count] % BLOCK
        gather = np.zeros((rows, columns), dtype=np.int64)
        gather[:count] = self.tables[which, :columns]
        host = np.zeros(rows, dtype=np.int64)  # the guesses in place on the host, then the rows' own next tokens
        guessed = np.ones(count, dtype=bool)
        guessed[starts] = False
        host[:count][guessed] = [t for g in guesses for t in g]
        tokens = _on(host, device)
        tokens[_on(starts, device)] = self.next_tokens
        return tokens, positions, write, gather

    def advance(self, steps: np.ndarray | int) -> None:
        """After a step: each row holds ``steps`` more positions (its next token, and the guesses it kept when it
        carried some); the blocks they filled go to the prefix cache."""
        n = self.n
        before = self.lengths[:n].copy()
        self.lengths[:n] += steps
        self._register_filled(n, before)

    def forward(self, guesses: list[list[int]] | None = None) -> torch.Tensor:
        """One decode step for every row; float32 logits (B, V) in row order. A forward that runs out of memory
        with several groups in the batch raises ``BatchOutOfMemory``: nothing moved (lengths advance only after
        a step), so the step can be retried once a group has left.

        Eager, the rows attend over a window just past the longest row. Compiled (SAKER_COMPILE), the step runs over
        a bucket of rows (padding rows point at the null block) and, on the CPU, a window bucket (``window``: 256,
        512, ... positions, up to the capacity; on CUDA the whole capacity), so that the shapes come from a fixed set
        whatever rows join and leave, each warmed up at start (``warm_up``).

        ``guesses`` (speculative decoding, fitted by ``fit_guesses``): each row's next token and its guesses are
        queries of their own, a guessed token a row of the step on its row's blocks at its own position (its keys
        and values written before any query reads them), so that a step checking guesses is the same decode-only
        step, compiled and captured as the others are, while its queries fit the warmed-up buckets. The logits are
        every query's (T, V), a row's in a run; the rows' lengths then advance by what the caller keeps
        (``advance``)."""
        runner, n = self.runner, self.n
        queries, reach = n, self.lengths[:n]
        if guesses is not None:
            guessed = np.fromiter((len(g) for g in guesses), dtype=np.int64, count=n)
            queries, reach = n + int(guessed.sum()), reach + guessed
        longest = int(reach.max()) + 1
        mixed = self.adapter is MIXED
        compiled = runner.compiled_step if not mixed and bucket(queries) <= self.top_rows else None
        if compiled is not None:
            rows = bucket(queries)
            width = self.capacity if self.static else window(longest, self.capacity)
        else:
            rows, width = queries, -(-longest // BLOCK) * BLOCK
        device = self.next_tokens.device
        if guesses is None:
            write, gather, positions = self._rows_inputs(rows, width)
            tokens = self.next_tokens
            if rows > n:
                tokens = torch.cat([tokens, tokens.new_zeros(rows - n)])
        else:
            tokens, positions, write, gather = self._guess_inputs(guesses, device, rows, width)
        extra = {} if compiled is not None else {"scratch": self.scratch}
        if mixed:
            extra["adapter_names"] = [g.params.adapter or "__base__" for g in self.groups for _ in range(g.rows)]
        pool = self.pool
        runner.inject("rows")
        if compiled is not None and self.static:  # a step of its own to CUDA graphs: the last one's logits are read
            torch.compiler.cudagraph_mark_step_begin()
        try:
            logits = (compiled or runner.rows_step)(
                tokens, _on(positions, device), _on(write, device), _on(gather, device), pool.keys, pool.values, **extra
            )
        except torch.OutOfMemoryError as exc:
            if len(self.groups) < 2:
                raise
            raise BatchOutOfMemory(exc) from None
        if guesses is None:
            self.advance(1)
        return logits[:queries] if rows > queries else logits

    def forward_with_chunks(
        self,
        chunks: list[tuple[list[int], list[int], int, str]],
        with_rows: bool = True,
        guesses: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """One flat forward (``attention.FlatStep``) for every row's next token (``with_rows``) and chunks of
        prompts being prefilled, each ``(table, ids, start, logits)``: ``ids`` at positions ``start..`` of the
        prompt whose blocks are ``table``. The prompts ride in the decode step instead of stalling it in forwards of
        their own. Returns the rows' float32 logits (rows, V) in row order (None without rows) and each chunk's: at
        each of its positions (``logits == "all"``: prompt scoring), at its last only (``"last"``: it ends the
        prompt), or none (``"none"``).

        ``guesses`` (speculative decoding; row order, fitted by ``fit_guesses``): each row computes its next token and
        its guesses at its next positions, and the rows' logits are every one of those tokens' (T, V), a row's in a
        run; the rows' lengths then advance by what the caller keeps (``advance``), not here."""
        from app.engine.model.attention import FlatStep

        pool = self._pool()
        device = pool.keys[0].device
        rows = self.n if with_rows else 0
        ids, at, writes, wanted, spans, gather, mask, row_positions = [], [], [], [], [], None, None, None
        if rows and guesses is not None:
            tokens, positions, write, gather = self._guess_inputs(guesses, device)
            rows = tokens.shape[0]  # a row's tokens are decode rows of their own from here: one query each
        elif rows:
            longest = int(self.lengths[:rows].max()) + 1
            write, gather, positions = self._rows_inputs(rows, -(-longest // BLOCK) * BLOCK)
            tokens = self.next_tokens
        if rows:
            ids, at, writes = [tokens], [positions], [write]
            gather, row_positions = _on(gather, device), _on(positions, device)
            width = gather.shape[1] * BLOCK
            mask = (torch.arange(width, device=device).view(1, -1) <= row_positions.view(-1, 1)).view(rows, 1, 1, width)
        offset, spans_of = rows, []
        for table, chunk, start, logits in chunks:
            count, end = len(chunk), start + len(chunk)
            blocks = np.asarray(table[: -(-end // BLOCK)], dtype=np.int64)
            positions = np.arange(start, end, dtype=np.int64)
            ids.append(torch.tensor(chunk, dtype=torch.long, device=device))
            at.append(positions)
            writes.append(blocks[positions // BLOCK] * BLOCK + positions % BLOCK)
            spans_of.append((_on(blocks, device), start, count))
            keep = {"all": range(offset, offset + count), "last": range(offset + count - 1, offset + count)}
            kept = keep.get(logits, range(0))
            spans.append((len(wanted) + rows, len(wanted) + rows + len(kept)))
            wanted += kept
            offset += count
        logits_at = torch.tensor([*range(rows), *wanted], dtype=torch.long, device=device)
        flat = FlatStep(
            pool.keys,
            pool.values,
            _on(np.concatenate(writes), device),
            rows,
            gather,
            mask,
            row_positions,
            tuple(spans_of),
            scratch=self.scratch,
        )
        self.runner.inject("flat")
        try:
            logits = self.runner.flat_step(torch.cat(ids), _on(np.concatenate(at), device), flat, logits_at)
        except torch.OutOfMemoryError as exc:
            if not rows:
                raise
            raise BatchOutOfMemory(exc) from None  # the newest prompt fails first, then the step is retried
        per_chunk = [logits[a:b] for a, b in spans]
        if not rows:
            return None, per_chunk
        if guesses is None:
            self.advance(1)
        return logits[:rows], per_chunk

    def _register_filled(self, n: int, before: np.ndarray) -> None:
        """Rows whose last step filled a block (prompt tail and generated tokens) keep it in the prefix cache, chained
        to the row's previous full block: a conversation that sends an answer back in its next prompt finds the
        answer's blocks too. ``before``: the rows' lengths before the step (a step moves a row by at most ``BLOCK``
        positions, so it fills at most one block)."""
        if not self.blocks.cached_limit:
            return
        filled = set(np.nonzero(self.lengths[:n] // BLOCK > before // BLOCK)[0].tolist())
        row = 0
        for group in self.groups:
            if not filled:
                break
            prompt = group.prompt_ids
            for seq in group.running:
                if row in filled:
                    filled.discard(row)
                    end = int(self.lengths[row]) // BLOCK * BLOCK  # the block's positions: [end - BLOCK, end)
                    start = end - BLOCK
                    # a block of the prompt's own was registered when it was computed; one shorter than a block is
                    # that of a row that ended within a speculative step's tokens (not kept)
                    fed = []
                    if end > len(prompt):
                        fed = prompt[start:] + seq.output_ids[max(0, start - len(prompt)) : end - len(prompt)]
                    if len(fed) == BLOCK:
                        key = (int(self.chains[row]), self.runner.prefix_salt(group.params.adapter), tuple(fed))
                        self.blocks.register(int(self.tables[row, end // BLOCK - 1]), key)
                        self.chains[row] = hash(key)
                row += 1

    def warm_up(self, max_rows: int, capacity: int) -> None:
        """Compiled steps: the pool allocated, then one step per batch bucket up to ``max_rows`` (on the CPU, per
        window as well) over padding rows, so that no request pays a compile or a graph capture (torch.compile makes
        the rows and the window dynamic at their second value: a few graphs in all). On CUDA the window is the whole
        ``capacity`` and each bucket is one recorded CUDA graph."""
        top = self.top_rows = bucket(max_rows)
        self.capacity = -(-capacity // BLOCK) * BLOCK
        pool = self._pool()
        device = pool.keys[0].device
        self.static = pool.static = device.type == "cuda"
        if self.static:
            for tensor in (*pool.keys, *pool.values):
                torch._dynamo.mark_static_address(tensor)
        for rows in BUCKETS + tuple(range(BUCKETS[-1] + 8, top + 1, 8)):
            if rows > top:
                break
            zeros = torch.zeros(rows, dtype=torch.long, device=device)
            for width in (self.capacity,) if self.static else windows(self.capacity):
                gather = torch.zeros(rows, width // BLOCK, dtype=torch.long, device=device)
                self.runner.compiled_step(zeros, zeros.clone(), zeros.clone(), gather, pool.keys, pool.values)


IDLE_KEEP = 64  # blocks an idle pool may have touched beyond twice its cached ones and keep its memory


def _on(array: np.ndarray, device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (no copy on the CPU)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)

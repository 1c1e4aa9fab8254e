"""A key group's chain of stored entries as fetched, in Arrow: the representation a restore leaves. No I/O.

``FetchedChain`` holds a key group's entries (oldest first, a ``full`` one
first) as Arrow record batches, with what it learned of them: their fold
(the live rows), how many keys they hold, whether they are sorted by key
(searchable), and the *pending* entries a native table added since the last
checkpoint (``add_pending``, replaced by what the checkpoint wrote:
``write_pending``). ``table.KeyGroupTable`` folds it into dicts only when
something needs all of the key group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_state.errors import KeyGroupNotLoadedError
from spark_state.executor.order import keys_ascending_each, sort_rows
from spark_state.model.schema import DELETED_COLUMN, KeyedSchema
from spark_state.store.blob import EntryKind
from spark_state.store.restore import check_chain, fold_chain, fold_chains

Entries = Sequence[tuple[EntryKind, pa.RecordBatch]]


def as_schema(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` cast to ``schema`` (a chain's entries share one schema), unchanged when it has it already."""
    return batch if batch.schema == schema else batch.cast(schema)


class FetchedChain:
    """A key group's chain as fetched (oldest entry first, starting with a full one), not yet folded."""

    def __init__(self, key_group: int, batches: Entries, schema: KeyedSchema, *, live: int | None = None):
        """``live``: the keys the chain holds, as its last entry's writer recorded (``BlobEntry.live``); counted
        when first needed otherwise. A count no chain of these entries could hold is ignored."""
        check_chain([kind for kind, _ in batches], f"key group {key_group}")
        self.batches = list(batches)
        self.schema = schema
        possible = live is not None and 0 <= live <= (
            self.batches[0][1].num_rows if len(self.batches) == 1 else sum(batch.num_rows for _, batch in self.batches)
        )
        self._live: int | None = live if possible else None
        self._folded: pa.Table | None = None
        self._nbytes: int | None = None
        self._search: list[tuple[pa.RecordBatch, pa.Array]] | None | Literal[False] = False  # False: not checked yet
        self.released = False
        self.pending = 0  # the last entries, added by ``add_pending``: changes no checkpoint has written yet

    def release(self) -> None:
        """Drop the chain's Arrow data, keeping its count of live keys (its overlay stands in for it)."""
        self.live_keys()
        self.batches, self._folded, self._nbytes, self.released = [], None, 0, True
        self._search = None

    def searchable(self) -> list[tuple[pa.RecordBatch, pa.Array]] | None:
        """The chain's entries, newest first, each with its key column, when every entry's rows are in strictly
        ascending order of the key (``KeyedSchema.sorted_key``): then a binary search per entry finds a key,
        without hashing the key group. None otherwise. Checked once, in one pass (``searchable_all``)."""
        return FetchedChain.searchable_all([self])[0]

    @staticmethod
    def searchable_all(chains: Sequence[FetchedChain]) -> list[list[tuple[pa.RecordBatch, pa.Array]] | None]:
        """``searchable`` of each chain, the entries of those not checked yet checked together in one pass
        (``keys_ascending``): after a restore, a batch touches the chains of hundreds of key groups, each with
        entries never checked, and a few Arrow calls per entry cost more than the comparisons."""
        unchecked = [chain for chain in chains if chain._search is False]
        key = unchecked[0].schema.sorted_key if unchecked else None
        eligible = [chain for chain in unchecked if not chain.released] if key is not None else []
        batches = [batch for chain in eligible for _, batch in chain.batches]
        flags = iter(keys_ascending_each(batches, key) if key is not None else [])  # key None: none eligible
        for chain in unchecked:
            chain._search = None
        for chain in eligible:
            if all([next(flags) for _ in chain.batches]):  # the sorted key: the blob schema's first column
                chain._search = [(batch, batch.column(0)) for _, batch in reversed(chain.batches)]
        return [None if chain._search is False else chain._search for chain in chains]  # none is False now

    def append(self, kind: EntryKind, batch: pa.RecordBatch) -> None:
        """The chain's next entry (a ``full`` one replaces the chain), as a checkpoint wrote it.

        A ``merge`` entry is kept like a delta: its rows are the latest
        values of the keys changed since the full entry, so folding it after
        the entries it replaces gives the same content.

        Under one key column, with the fold already computed (or a ``full``
        entry), the chain is kept folded instead: one full entry of its live
        rows, the entry's rows replacing the keys they name (``fold_chain``'s
        rule). The content is the same; memory and the next lookup's work are
        those of the live rows, not of every entry since the last compaction.
        """
        template = self.batches[0][1].schema
        batch = as_schema(batch, template)
        previous, self._folded, self._live, self._nbytes = self._folded, None, None, None
        self._search = False
        if len(self.schema.key_columns) != 1 or (kind != "full" and previous is None):
            self.batches = [(kind, batch)] if kind == "full" else self.batches + [(kind, batch)]
            return
        deleted = batch.column(DELETED_COLUMN)
        live = pa.Table.from_batches([batch.filter(pc.invert(deleted)) if pc.any(deleted).as_py() else batch])
        live = live.drop_columns([DELETED_COLUMN])
        if kind != "full":  # a delta, or a merge (the keys changed since the full entry): the rows replace theirs
            assert previous is not None, "a delta or merge without a fold returned above"
            key = self.schema.key_columns[0]
            kept = previous.filter(
                pc.invert(pc.is_in(previous.column(key), value_set=batch.column(key), skip_nulls=False))
            )
            live = pa.concat_tables([kept, live])
            if self.schema.sorted_key is not None:  # two sorted runs: a stable sort merges them in one pass
                live = sort_rows(live.combine_chunks(), key)
        live = live.combine_chunks()
        columns = [c.chunk(0) if c.num_chunks else pa.array([], c.type) for c in live.columns]
        whole = pa.RecordBatch.from_arrays(columns + [pa.array(np.zeros(live.num_rows, bool))], schema=template)
        self.batches = [("full", whole)]
        self._folded = pa.Table.from_batches([whole]).drop_columns([DELETED_COLUMN])
        self._nbytes = whole.get_total_buffer_size()

    def add_pending(self, batch: pa.RecordBatch, new_keys: int) -> None:
        """Add a batch's changed rows of the key group as its newest entry, not written yet.

        ``batch``: the blob schema, each key once, no tombstone, in strictly
        ascending key order under a sorted key (``KeyedSchema.sorted_key``);
        ``new_keys`` of its keys are not in the chain. The checkpoint's
        entry for the key group replaces the pending entries
        (``write_pending``).
        """
        batch = as_schema(batch, self.batches[0][1].schema)
        live = self.live_keys()  # counted before the entry: then counting after costs nothing
        self.batches.append(("delta", batch))
        self.pending += 1
        self._folded, self._nbytes, self._live = None, None, live + new_keys
        if self._search:  # every entry known sorted, and so is this one
            self._search = [(batch, batch.column(0)), *self._search]  # the sorted key: the blob schema's first

    def whole_pending(self) -> pa.RecordBatch | None:
        """The one pending entry when it holds every live key of the chain, else None. Then it is the chain's
        fold: each key once, no tombstone, by ascending key (``put_arrow``'s entries)."""
        if self.pending != 1 or self._live is None:
            return None
        batch = self.batches[-1][1]
        return batch if batch.num_rows == self._live else None

    def write_pending(
        self, kind: EntryKind, written: pa.RecordBatch, ascending: bool, *, live: int | None = None
    ) -> None:
        """A checkpoint wrote the pending changes as ``written``, a ``kind`` entry: it replaces them.

        A ``full`` entry becomes the whole chain; a ``merge`` entry (every
        key changed since the chain's full entry) follows that full entry;
        a ``delta`` follows the written entries. The content is unchanged.
        ``ascending``: the entry's keys are in strictly ascending order, no
        null among them (``keys_ascending``); the chain is then searchable
        without checking its entries again, when its older entries were (a
        merge keeps the full entry's check). ``live``: the keys the chain
        holds with the entry, when it also wrote changes the pending entries
        do not hold (an overlay's); the pending entries' count is then short
        of the keys new to the chain there, and a count short of the chain's
        keys makes a later pending entry of that many keys pass for the whole
        key group (``whole_pending``), whose full entry would drop the others.
        """
        written = as_schema(written, self.batches[0][1].schema)
        pending, self.pending = self.pending, 0
        committed = self.batches[: len(self.batches) - pending]
        self._folded, self._nbytes = None, None
        if live is not None:
            self._live = live
        if kind == "full" or not committed:  # a new key group's first entry holds all of it
            self.batches = [("full", written)]
            self._live = written.num_rows - written.column(DELETED_COLUMN).true_count
            self._search = [(written, written.column(0))] if ascending else None
        elif kind == "merge":
            self.batches = [*committed[:1], ("merge", written)]
            if self._search:  # the full entry's keys known ascending (the oldest searched): the merge's decide
                self._search = [(written, written.column(0)), self._search[-1]] if ascending else None
            elif self._search is not None:
                self._search = False  # not checked yet: both entries are, when next searched
        else:
            self.batches = [*committed, (kind, written)]
            if self._search:  # as ``searchable``: keys not strictly ascending, no search
                self._search = [(written, written.column(0)), *self._search[pending:]] if ascending else None

    def extend(self, batches: Entries) -> None:
        """Append committed entries a catch-up fetched (the chain has no pending entry)."""
        template = self.batches[0][1].schema
        self.batches += [(kind, as_schema(b, template)) for kind, b in batches]
        self._folded, self._nbytes, self._live, self._search = None, None, None, False

    def nbytes(self) -> int:
        """Bytes of the chain's Arrow buffers, and of its fold once computed."""
        if self._nbytes is None:
            # The buffers' sizes (a fortieth of the cost of ``nbytes``, which walks offsets: thousands of chains
            # are measured after a restore); a sliced array counts its whole buffers, which only overstates.
            folded = self._folded.get_total_buffer_size() if self._folded is not None and len(self.batches) > 1 else 0
            self._nbytes = sum(batch.get_total_buffer_size() for _, batch in self.batches) + folded
        return self._nbytes

    def folded(self) -> pa.Table:
        """The chain's live rows (``restore.fold_chain``), computed once."""
        if self.released:
            raise KeyGroupNotLoadedError("a released chain was read (a defect of spark-state, please report it)")
        if self._folded is None:
            self._folded = fold_chain(self.batches, self.schema.key_columns)
            if len(self.batches) > 1:
                self._nbytes = None  # a new table beside the chain (one full entry's fold shares its buffers)
        return self._folded

    @staticmethod
    def live_rows(chains: Sequence[FetchedChain], key_columns: Sequence[str]) -> pa.Table:
        """The live rows of ``chains`` (key groups' chains of one schema), concatenated.

        A chain folded before gives its fold; the others are folded together
        (one ``restore.fold_chains``, not a few Arrow calls per key group: a
        batch after a rescale touches every key group of its instance, with a
        few keys each). Their folds are not kept: a key group looked up again
        is folded into dicts instead (``KeyGroupTable._look_up``).
        """
        done = [chain.folded() for chain in chains if chain._folded is not None or chain.released]
        rest = [chain.batches for chain in chains if chain._folded is None and not chain.released]
        parts = done + ([fold_chains(rest, key_columns)] if rest else [])
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]

    def live_keys(self) -> int:
        """Keys the chain holds once folded (computed once, with Arrow kernels on the key columns)."""
        if self._live is None and self._folded is not None:
            self._live = self._folded.num_rows
        if self._live is None and len(self.batches) == 1:  # an entry holds each key once: its rows, less tombstones
            batch = self.batches[0][1]
            self._live = batch.num_rows - batch.column(DELETED_COLUMN).true_count
        if self._live is None:
            columns = list(self.schema.key_columns) + [DELETED_COLUMN]
            self._live = fold_chain([(k, b.select(columns)) for k, b in self.batches], self.schema.key_columns).num_rows
        return self._live

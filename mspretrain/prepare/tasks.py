"""The tasks prepare's main process hands its workers on the pieces path (pass 1's chunks in
files, `pipeline.LOCAL_PIECES`): what one work item, one chunk's dedup records and one chunk's
replay are. Named tuples: a task is pickled to a worker as the tuple it is, and read there by name.
What the workers send back is in `results.py`."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class SpillTask(NamedTuple):
    """One work item of pass 1 (`workers.spill_item`): a chunk (or a compressed file, `sources.FileUnit`)
    cleaned into the file `path` of pass 1's chunk dir, its dedup records grouped for the partition files."""
    work: object  # what `workers.clean_chunk` takes, or a `sources.FileUnit`
    path: str  # the chunk's file (`workdir.PIECES`/ITEM: the work item's number)
    exact_parts: int  # the dedup partition files of exact keys ...
    band_parts: int  # ... and of LSH band keys (0: exact dedup only)


class PlaceRecords(NamedTuple):
    """One chunk's dedup records (`diskdedup.chunk_records`, in the file `path`) to write where the
    main process reserved their place (`diskdedup.place_records`)."""
    path: str  # the chunk's `.dd` file, removed once placed
    base: int  # the chunk's first document: added to each record's idx
    places: list  # per kind of record (exact, bands): [(partition file, offset, first record, end record)]


class ReplayTask(NamedTuple):
    """One chunk of the replay on the pieces path (`workers.replay_chunk`): its kept documents cut
    into the shard and origin sections of each split."""
    src: str  # the chunk's file in pass 1's chunk dir
    dst: str  # the piece file to write (`workdir.REPLAY_PIECES`/CHUNK)
    drop: np.ndarray  # bool per cleaned document: an exact or near duplicate
    valid_fraction: float
    has_origin: bool
    dtype: np.dtype  # the shards' token dtype
    text_piece: bool  # the chunk's file holds texts: encoded with the trained tokenizer


class Copy(NamedTuple):
    """One section of a replay piece copied into an output file."""
    path: str  # the output file
    at: int  # its offset there (reserved by the main process)
    src_at: int  # its offset in the piece
    n: int  # bytes


class PlacePiece(NamedTuple):
    """A replay piece's sections copied into the outputs (`workers.place_piece`), then the piece removed."""
    piece: str
    copies: list[Copy]

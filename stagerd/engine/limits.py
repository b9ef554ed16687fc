"""The engine's fixed sizes. Read at call time (`limits.BUFFER_BYTES`), so a test can shrink them."""

from __future__ import annotations

import os

COPY_PIECE = 64 << 20  # split big copies so threads share the work evenly
BUFFER_BYTES = 8 << 20  # per-thread cast / gather buffer
CAST_ROUND = 512 << 10  # wider side per cast round: pread, cast and pwrite then stay in L2
DROP_BEHIND = 64 << 20  # written output this far behind the newest byte is waited on and dropped (0: kept)
DROP_QUEUE = 8  # the copy threads wait once this many drops are pending (the disk is that far behind)
DIRECT_MIN_RUN = 1 << 20  # strided runs at least this long are copied run by run instead of gathered
MAX_GRID_CELLS = 1 << 22  # tilings with more grid cells than this are checked pair by pair
SCATTER_MIN_SEGMENT = 512  # gather segments at least this long are read in place with preadv
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024)
PACK_TENSOR = 256 << 10  # tensors this small are packed, many to one move (engine/pack.py)
PACK_PIECES = 1024  # source blocks per pack: what one pack move holds as objects (a few hundred kB)
PACK_RUNS = 64  # a tensor split into more runs than this gets its own moves
# Inputs beyond the descriptor budget (contract/step/input_fds.LazyFds): moves are taken this many (and
# bytes) at a time and run grouped by source file, so each file is opened again at most once a batch
SOURCE_BATCH = 4096  # moves, a gather counted by its pieces
SOURCE_BATCH_BYTES = 256 << 20

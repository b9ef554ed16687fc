# The compiled tile-wise strided copy (_tiles.c): byte strides, bounds checked, GIL released.

def copy2d(
    src: memoryview | bytes | bytearray,
    src_offset: int,
    src_row: int,
    src_col: int,
    dst: memoryview | bytearray,
    dst_offset: int,
    dst_row: int,
    dst_col: int,
    rows: int,
    cols: int,
    itemsize: int,
    /,
) -> None: ...
def read_runs(fd: int, dst: memoryview | bytearray, starts: memoryview | bytes, run: int, /) -> int: ...

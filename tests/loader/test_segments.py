"""A batch's segments placed at once (``segments.place_rows``) are each sample's template moved to its row."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_cache.format.geometry import SampleShape
from dspark_cache.loader.records import SEG_COPY, SEG_DEQUANT, SEGMENT
from dspark_cache.loader.segments import BUFFERS, place_rows, row_template

STRIDES = np.array([1000, 200, 30, 4, 50, 6], dtype=np.uint64)  # bytes per row of each of BUFFERS
HEADER_BUF, HEADER_STRIDE = len(BUFFERS), 4096


def moved(segs: np.ndarray, header: int, row: int) -> list[tuple[int, ...]]:
    """The template's segments moved by hand: payload offsets after the header, buffer offsets at the row."""
    out = []
    for seg in segs.tolist():
        f = dict(zip(SEGMENT.names, seg))
        f["src_off"] += header
        f["off"] += int(STRIDES[f["buf"]]) * row
        if f["col_bytes"] or f["pick_count"]:
            f["col_dst"] += int(STRIDES[f["col_buf"]]) * row
        if f["kind"] == SEG_DEQUANT:
            f["scale_off"] += int(STRIDES[f["scale_buf"]]) * row
        out.append(tuple(f.values()))
    return out


@pytest.mark.parametrize("dtype,out_code,select", [("BF16", None, None), ("F8_E4M3", "BF16", None),
                                                   ("F8_E4M3", None, (2, 0)), ("BF16", None, (1,))])
def test_every_sample_is_its_template_at_its_row(dtype, out_code, select):
    shape = SampleShape((1, 4, 7), 8, 16, dtype)
    lengths, headers, rows = [5, 0, 12], [128, 256, 4000], [2, 0, 1]  # 0 tokens: only the header is read
    templates = [row_template(n, shape, out_code, vocab_size=100, select=select) for n in lengths]
    segs, counts = place_rows(
        templates, np.array(headers), np.array(rows), STRIDES, HEADER_BUF, HEADER_STRIDE
    )
    assert segs.dtype == SEGMENT and counts.tolist() == [len(t.segs) + 1 for t in templates]
    assert counts[1] == 1
    first = 0
    for template, header, row, count in zip(templates, headers, rows, counts):
        placed = segs[first : first + count].tolist()
        head = dict(zip(SEGMENT.names, placed[0]))
        assert (head["kind"], head["src_off"], head["len"], head["buf"], head["off"]) == (
            SEG_COPY, 0, header, HEADER_BUF, row * HEADER_STRIDE)
        assert placed[1:] == moved(template.segs, header, row)
        first += count
    assert first == len(segs)

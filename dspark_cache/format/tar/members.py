"""A shard tar's members: names, headers and byte placement, shared by the writer and by size planning."""

from __future__ import annotations

import tarfile

from dspark_cache.format.paths import sample_key
from dspark_cache.format.sample import PayloadLayout, TensorSpec, layout_payload

TAR_BLOCK = 512
END_OF_ARCHIVE = 2 * TAR_BLOCK


def member_name(sample_id: int) -> str:
    return f"{sample_key(sample_id)}.safetensors"


def member_header(name: str, size: int) -> bytes:
    """A deterministic USTAR header (mtime 0, root-owned) so equal runs give equal bytes."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def block_padding(size: int) -> int:
    return -size % TAR_BLOCK


class TarCursor:
    """Tracks the next member position as the writer appends samples."""

    def __init__(self) -> None:
        self.offset = 0

    def lay_out(self, specs: list[TensorSpec], metadata: dict[str, str]) -> tuple[int, PayloadLayout]:
        """The next sample's payload offset and layout, not yet placed: :meth:`advance` by the size it
        is stored in (a compressed sample's is known once its frame is made)."""
        data_offset = self.offset + TAR_BLOCK
        return data_offset, layout_payload(specs, metadata, data_offset)

    def advance(self, size: int) -> None:
        """Place the member laid out last, its payload ``size`` bytes."""
        self.offset += TAR_BLOCK + size + block_padding(size)

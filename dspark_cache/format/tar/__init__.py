"""Shard files: plain USTAR tars of sample blobs, plus the ``.idx`` that publishes them."""

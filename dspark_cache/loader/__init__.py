"""The training side: read a cache (complete or growing) into NeMo-shaped batches."""

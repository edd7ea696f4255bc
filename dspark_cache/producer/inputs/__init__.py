"""``--input-data`` read as rows, each with its location, in a fixed order (the first stage).

* ``rows``: what reading yields (``RawRow``, ``InvalidRow``), ``InputError``, the nesting check
  and regular-file opening.
* ``split``: ``--split`` in Hugging Face's slice syntax (``SplitSpec``).
* ``jsonl``: JSONL lines read with a size limit and indexed by offset (``LineIndex``).
* ``parts``: a JSONL file, a JSON document or a dataset, read in order or by position.
* ``source``: what ``--input-data`` is, and ``InputSource``, which yields its selected rows.

The rest of the producer uses ``InputSource`` (``source``) and ``RawRow``, ``InvalidRow``,
``InputError`` (``rows``).
"""

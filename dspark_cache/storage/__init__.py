"""Where a cache lives: a local directory or an object store, read and written through one interface.

``format`` says what the bytes of a cache are; this package says where they are and who may write
them. The read side is :class:`~.cache.CacheDir` over a backing (:mod:`.backing`: the directory
itself, or a node-local mirror of a store); the write side is :class:`~.output.CacheOutput` (the
directory's lock, which files are ours, publication) or, for ``s3://``, its subclass in
:mod:`.remote.output` that stages locally and makes the store follow. Everything that talks to an
object store is under :mod:`.remote`. It imports ``format`` and nothing else of the package.
"""

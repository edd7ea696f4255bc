"""A cache on object storage (``s3://``, ``gs://``, ``az://``): the store client, URLs, the lease, uploads,
the node-local mirror a reader reads through and the staging directory a producer writes through."""

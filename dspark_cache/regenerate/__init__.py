"""``dspark-regenerate``: the step before ``dspark-produce``. It sends chat rows to a running
OpenAI-compatible server (vLLM, SGLang, ``transformers serve``) and writes them back with their
assistant turns answered by the target itself, in the ``messages`` form ``dspark-produce`` reads.

We are the client, not an engine: parallelism across GPUs and nodes is the server's. One module
per concept, importing one way:

* ``settings``: every option (``RegenerateConfig``), the run's identity and the per-row seed.
* ``client``: one HTTP request to one endpoint (stdlib ``http.client``, keep-alive per thread),
  failures sorted into those worth retrying and those that are not.
* ``endpoints``: the endpoints in rotation, a dead one taken out and tried again later, the
  model each serves (``/v1/models``), and the retry loop of one chat request.
* ``conversation``: which assistant turns a row regenerates (``--turns``) and the row rebuilt.
* ``output``: the output file and its sidecars (run record, lock, skipped rows, failed rows) and the resume
  index; ``writer``: the writer that appends rows in input order.
* ``run``: reading, the worker threads, progress, the policies; ``cli``: the command line.

Input is read by the producer's own code (``dspark_cache.producer``'s public ``InputSource`` and
``normalise_row``), so every form and bad-row policy of ``dspark-produce`` holds here unchanged.
"""

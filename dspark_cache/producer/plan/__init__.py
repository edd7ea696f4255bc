"""Samples into the plan: global length-grouped batches, shards of whole batches with their exact
bytes, saved in the output directory and made once per job.

* ``batches``: ``Plan``, ``ShardPlan``, ``PlannedSample`` over flat arrays, and
  ``plan_from_rows``, which orders samples, cuts batches and shards and sizes every shard.
* ``parts``: one encoding rank's share of the input, written as a part of the saved plan.
* ``store``: the saved plan: its keys (encode and batching), merging parts, checking, saving and
  loading it.
* ``found``: what a dry run found in the output directory, put back when it fails.
* ``job``: the job's plan across ranks (``plan_job``): reuse the saved plan or parts, or encode
  and merge.

The rest of the producer uses ``Plan``, ``ShardPlan``, ``PlannedSample`` (``batches``),
``plan_job`` (``job``) and ``found``'s functions for what a dry run found in the output directory.
"""

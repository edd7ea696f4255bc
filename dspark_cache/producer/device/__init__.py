"""The device stage: this rank's place in the job, the target on its device, the compute loop.

What the rest of the producer may use, by module (everything else here is the stage's own):

* ``topology``: ``Topology`` (this rank's data- and model-parallel facts, from torchrun's
  environment and the settings), ``check_topology``, ``ParallelError``, ``size_argument``.
* ``ranks``: the job's ranks with each other: ``new_run_id``, ``barrier_before_setup``,
  ``share_setup``, ``all_true``, ``all_texts``, ``assign_shards``, ``await_other_ranks``.
* ``model_group``: a model-parallel group: ``check_target`` (whether the target splits over it);
  joining it, its per-batch vote and the partner watch are ``compute``'s.
* ``target``: ``read_target_info``, ``TargetInfo``, ``resolve_device``, ``TargetRunner``, ``TargetError``.
* ``checkpoint``: the files of the target that load and their fingerprint (``target``'s).
* ``masks``: the causal mask mapping the target's forward takes (``target``'s).
* ``compute``: ``compute_shards``, ``Computed``, ``write_missing_target_weights``,
  ``repair_complete_weights``.

Importing this package imports nothing: ``topology`` stays torch-free for ``dspark-produce --help``.
"""

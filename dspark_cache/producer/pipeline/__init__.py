"""The device-to-writer pipeline: target forward | copy into host memory | shard writing.

* ``loop``: ``run_pipeline``, the main thread's loop (``collate``, the forward, the finite
  check, FP8 storage form), overlapped with the copies and the writers.
* ``schedule``: the order batches are computed in with several shards in flight (``ShardSchedule``,
  which a model-parallel group's partners run too).
* ``host_ring``: the fixed host-memory ring (``HostRing``) and the copies into it (``HostCopier``).
* ``writer``: the writer lanes, a thread and an open shard each, which append the host ring's batches to
  their shards and publish them (``WriterLanes``, ``PipelineStats``).
* ``timing``: stage times from CUDA events on a GPU, host timers on a CPU.
* ``tensors``: torch dtypes of the format's codes, tensors as writer bytes, FP8 quantisation.

The rest of the producer uses ``run_pipeline``, ``collate`` (``loop``), ``ShardSchedule``
(``schedule``), ``PipelineStats`` (``writer``) and ``torch_dtype`` (``tensors``).
"""

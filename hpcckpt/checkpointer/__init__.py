"""The parts ``api.Checkpointer`` delegates to, one concern each.

- ``setup``: options and lease (the policy, the writer lease, the levels and the engine,
  each from the options resolved once).
- ``restore``: the newest usable checkpoint, read back into the registered objects.
- ``accumulation``: whether a boundary falls inside a gradient accumulation, its gradients.
- ``loaders``: which saved pass a loader resumes (its key), and how the script iterates it.
- ``passes``: the boundaries the loops owe at pass and epoch ends.
- ``saves``: the saves in flight and the newest committed step.
- ``trace``: ``hpcckpt check``'s trace.
- ``driven``: a trainer's own loop driving the boundaries (the integrations' seam).

When and why a run stops is the lifecycle's (``lifecycle.stop``), not a part of these.
"""

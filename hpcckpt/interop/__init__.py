"""Interoperation with other checkpoint formats: ``dcp`` (torch.distributed.checkpoint)."""

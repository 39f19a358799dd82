"""Errors a training script sees."""


class MisuseError(RuntimeError):
    """The script uses the API or torch.distributed in a way the runtime cannot keep consistent:
    it would fail the same way on any node (the job fails instead of recovering)."""

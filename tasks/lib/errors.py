"""The one exception a step raises for bad input."""


class StepError(Exception):
    """Bad input or a failed check: reported as one line naming the input, exit code 2."""

"""The local stack of the local launcher mode (see ``python -m stack --help``)."""

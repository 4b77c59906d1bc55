"""The local stack of the embedded default (see ``python -m stack --help``)."""

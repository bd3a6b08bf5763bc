"""The tiny arithmetic corpus of the training tests, for real runs to compare."""

from tests.train.conftest import tiny_corpus  # noqa: F401 (a fixture, used by name)

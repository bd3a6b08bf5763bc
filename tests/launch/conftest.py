from tests.train.conftest import tiny_corpus  # noqa: F401  (the training tests' corpus fixture)

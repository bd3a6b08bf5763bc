"""Tokenized training data: Megatron `.bin/.idx` files and the preprocessing that writes them.

The `preprocess` function is `lmforge.data.preprocess.preprocess`; it is not re-exported here, where
its name would hide the `lmforge.data.preprocess` module (and break `import lmforge.data.preprocess
as pp`).
"""

from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from lmforge.data.preprocess import PreprocessStats

__all__ = ["IndexedDataset", "IndexedDatasetWriter", "PreprocessStats", "optimal_dtype"]

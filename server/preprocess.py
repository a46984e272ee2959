"""Model-declared pre-processing: text to token tensors with the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from server.config import Tokenize
from server.errors import EngineError


class TextTokenizer:
    """Tokenizes one request's texts, truncated to max_length and padded to their longest.

    The Rust tokenizer releases the GIL and is safe to share between threads.
    """

    def __init__(self, spec: Tokenize, version_dir: Path) -> None:
        path = version_dir / spec.tokenizer
        if not path.is_file():
            raise EngineError(f"tokenizer file {path} is missing")
        self._tokenizer = Tokenizer.from_file(str(path))
        self._tokenizer.enable_truncation(max_length=spec.max_length)
        self._tokenizer.enable_padding(pad_id=spec.pad_id)
        self.spec = spec

    @property
    def outputs(self) -> dict[str, int]:
        """The token tensors produced, with the value each is padded with."""
        names = {self.spec.input_ids: self.spec.pad_id}
        for name in (self.spec.attention_mask, self.spec.token_type_ids):
            if name:
                names[name] = 0
        return names

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        encodings = self._tokenizer.encode_batch(texts)
        tensors = {self.spec.input_ids: np.array([e.ids for e in encodings], dtype=np.int64)}
        if self.spec.attention_mask:
            tensors[self.spec.attention_mask] = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        if self.spec.token_type_ids:
            tensors[self.spec.token_type_ids] = np.array([e.type_ids for e in encodings], dtype=np.int64)
        return tensors

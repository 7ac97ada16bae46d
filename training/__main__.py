"""`python -m training <recipe> ...` (see `training.cli`)."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

from training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

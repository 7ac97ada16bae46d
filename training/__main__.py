"""`python -m training <recipe> ...` (see `training.cli`)."""

import contextlib
import os
import re
import sys
import tempfile

# TensorFlow's C++ start-up lines (oneDNN, CUDA probing, CPU features) are noise in a
# terminal that shows a progress bar. TF_CPP_MIN_LOG_LEVEL must be set before TensorFlow is
# imported; TensorFlow 2.21 still prints the lines it logs before absl is initialised
# whatever the level, so those are filtered out of stderr while Keras imports it (below).
_USER_LOG_LEVEL = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# absl's "WARNING: All log messages before absl::InitializeLog()..." and its glog-style
# lines: I0000 00:00:1795431559.661154    5964 port.cc:153] ...
NATIVE_LOG_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\)|"
    r"[IWE]\d{4} [\d:. ]+\d+ [\w.]+:\d+\]|"
    r"To enable the following instructions: .* rebuild TensorFlow)"
)


@contextlib.contextmanager
def quiet_native_start_up():
    """Drop TensorFlow's native start-up log lines from stderr (file descriptor 2) inside
    the block; everything else written to stderr meanwhile is passed on afterwards. Does
    nothing when the user set TF_CPP_MIN_LOG_LEVEL below 3 (they asked for the logs)."""
    if _USER_LOG_LEVEL not in (None, "3"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode("utf-8", "replace").splitlines(keepends=True):
                if not NATIVE_LOG_LINE.match(line):
                    sys.stderr.write(line)
            sys.stderr.flush()


with quiet_native_start_up():
    import keras  # noqa: E402  (imports TensorFlow on its backend)

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf  # noqa: E402

        tf.config.list_physical_devices()  # probes CUDA now, inside the filter

from training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

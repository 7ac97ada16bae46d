"""The bookkeeping of tests/run_backends.py (`make test`), on files written here."""

import pytest

from tests import run_backends as rb


def test_workers_parse_and_bad_items_are_named():
    assert rb.parse_workers("") == {"jax": 2, "tensorflow": 2, "torch": 1}
    assert rb.parse_workers("torch=3, jax=1") == {"jax": 1, "tensorflow": 2, "torch": 3}
    for bad in ("mxnet=2", "jax=0", "jax", "torch=two"):
        with pytest.raises(SystemExit, match="BACKEND=N"):
            rb.parse_workers(bad)


def test_progress_and_summaries(tmp_path):
    log = tmp_path / "jax.log"
    assert rb.progress(str(tmp_path / "missing.log")) is None
    log.write_text("....  [ 11%]\n.....F [ 22%]\n")
    assert rb.progress(str(log)) == 22
    log.write_text("....\n=================== FAILURES ===================\n"
                   "___ test_x ___\nE  assert 1 == 2\n= 1 failed, 4 passed in 3.0s =\n")
    failed = rb.summary(str(log), failed=True)
    assert failed.startswith("=================== FAILURES") and "assert 1 == 2" in failed
    log.write_text("....\n\n4 passed in 3.0s\nI0000 cudart_stub.cc:31] no cuda drivers\n")
    assert rb.summary(str(log), failed=False) == "4 passed in 3.0s"

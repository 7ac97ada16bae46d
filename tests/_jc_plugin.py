import logging, os, re, collections, time
import jax
jax.config.update("jax_log_compiles", True)
T = collections.Counter(); C = collections.Counter()
class H(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        mm = re.search(r"Finished .*?compilation of (\S+) in ([\d.e-]+) sec", msg)
        if mm:
            T[mm.group(1)] += float(mm.group(2)); C[mm.group(1)] += 1
for name in ("jax",):
    lg = logging.getLogger(name); lg.addHandler(H()); lg.setLevel(logging.DEBUG)
def pytest_sessionfinish(session):
    with open(os.environ["JC_OUT"], "a") as f:
        f.write(f"cpu {time.process_time():.1f} total {sum(T.values()):.1f}s n={sum(C.values())}\n")
        for k, v in T.most_common(8):
            f.write(f"{v:8.2f}s {C[k]:5d} {k}\n")

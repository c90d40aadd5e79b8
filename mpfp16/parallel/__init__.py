"""mpfp16's parallel layer; :mod:`mpfp16.distributed` is its public face.

Its modules, higher first; each imports only from the lines below its own (the
import-linter contract in pyproject.toml):

- ``ddp``: ``wrap()`` (DistributedDataParallel with an mpfp16 hook), the rules on its
  options, the hook state a checkpoint keeps; ``fsdp``: ``shard()`` (FSDP2 with fp32
  masters), the rules on its dtypes, gradient sync, the buffer sync; ``replicas``: the
  exact cross-rank replica check;
- ``hooks``: the DDP communication hooks and their accounting (``CommStats``);
  ``setup``: ``init()``, ``teardown()``, logging, the timeout default; ``fsdp_shim``:
  the only user of FSDP2's private API;
- ``powersgd``: torch's PowerSGD state, kept for exact resumes; ``handles``: one
  handle per wrapped or sharded model;
- ``ranks``: rank helpers and "every rank agrees", importing nothing from mpfp16.

Nothing is imported here, so that importing ``mpfp16.parallel.ranks`` stays light.
"""

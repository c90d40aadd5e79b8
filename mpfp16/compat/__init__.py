"""Drop-in layers for code written against other mixed-precision APIs, on top of the
mpfp16 library: :mod:`mpfp16.compat.apex` (apex's legacy ``fp16_utils`` and
``apex.parallel.DistributedDataParallel``)."""

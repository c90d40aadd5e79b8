"""mpfp16 inside other people's training loops.

- :mod:`mpfp16.integrations.lightning`: precision plugins for PyTorch Lightning's
  ``Trainer`` (``MPFP16Precision``) and ``Fabric`` (``MPFP16FabricPrecision``); needs
  ``pip install 'mpfp16[lightning]'``.

``import mpfp16`` imports none of them.
"""

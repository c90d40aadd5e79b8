"""mpfp16 inside other people's training loops.

- :mod:`mpfp16.integrations.lightning`: precision plugins for PyTorch Lightning's
  ``Trainer`` (``MPFP16Precision``) and ``Fabric`` (``MPFP16FabricPrecision``); needs
  ``pip install 'mpfp16[lightning]'``.
- :mod:`mpfp16.integrations.transformers`: ``MPFP16Trainer``, a Hugging Face
  ``transformers.Trainer``; needs ``pip install 'mpfp16[transformers]'``.
- :mod:`mpfp16.integrations.front_end`: the options both check and build from.

``import mpfp16`` imports none of them.
"""

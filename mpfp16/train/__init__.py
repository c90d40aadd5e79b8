"""The training application on top of the library: what train_cifar.py and
train_imagenet.py run (flags, config, data, models, the loop, checkpoints, metrics,
run directories, preemption). ``import mpfp16`` does not import it."""

"""train_imagenet.py -a vit_b_16: fp16 with fp32 masters at the run's image size, fp32
LayerNorms, attention far from fp16's overflow at the default loss scale, and image
sizes a ViT cannot take refused in one line.

ViT-B/16 has 86M parameters and fp16 is slow on a CPU: the runs are 32x32 images
(4 patches), batches of 2 and three steps.
"""

import math
import os

import pytest
import torch
import torch.nn as nn

import mpfp16
import train_imagenet
from mpfp16.train import models
from mpfp16.train.config import TrainConfig
from reference import saved_masters
from run_helpers import records, run_main

FP16_MAX = torch.finfo(torch.float16).max
TINY_VIT = ["-a", "vit_b_16", "--image-size", "32", "-b", "2", "--synthetic-size", "6,2", "--max-steps", "3",
            "-j", "0", "-p", "1", "--no-progress", "--fused", "off"]


@pytest.mark.slow
def test_vit_b_16_trains_in_fp16_at_the_run_image_size(tmp_path, capsys):
    status, err = run_main(train_imagenet.main, [*TINY_VIT, "--checkpoint-dir", str(tmp_path)], capsys)
    assert status == 0, err
    recs = records(tmp_path / "metrics.jsonl")
    train = [r for r in recs if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in train)
    # A skip is a step whose record raised the count. The only ones allowed are the
    # scaler backing off before the first step taken (torchvision zero-initializes the
    # classifier, whose first gradient in a batch of 2 can pass 65504 at 2**16; see
    # the test below): once a step is taken, none is skipped.
    skipped = [r["skipped_steps"] - before for r, before in zip(train, [0] + [r["skipped_steps"] for r in train])]
    first_taken = skipped.index(0)
    assert first_taken <= 1 and not any(skipped[first_taken:]), skipped
    assert all(math.isfinite(r["grad_norm"]) for r, s in zip(train, skipped) if not s)
    # Evaluated at the training size, the only one the model takes.
    evals = [r for r in recs if r["type"] == "eval"]
    assert evals[-1]["val_samples"] == 2 and math.isfinite(evals[-1]["val_loss"])
    assert recs[-1]["type"] == "final" and recs[-1]["step"] == 3

    ckpt = torch.load(tmp_path / "last.pt", weights_only=True, mmap=True)
    state = ckpt["model"]
    assert state["encoder.pos_embedding"].shape == (1, 4 + 1, 768)  # built for 32x32: 4 patches and the class token
    with torch.device("meta"):
        reference = models.build_imagenet_model("vit_b_16", 10, image_size=32)
    norms = []
    for module_name, module in reference.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}" if module_name else name
            if isinstance(module, nn.LayerNorm):
                norms.append(module_name)
                assert state[key].dtype == torch.float32, key
            else:
                assert state[key].dtype == torch.float16, key
    assert len(set(norms)) == 2 * 12 + 1 and "encoder.ln" in norms  # two per block, and the encoder's final one
    masters = [m for m in saved_masters(ckpt["optimizer"]) if m is not None]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    del ckpt, state
    for name in ("last.pt", "best.pt"):  # 860 MB each
        os.unlink(tmp_path / name)


@pytest.mark.slow  # three fp16 steps of the whole ViT-B/16 on CPU: 7.4 s in one process, over 10 s on a cold page cache
def test_attention_gradients_are_far_below_overflow_at_the_default_loss_scale():
    """Attention's gradients, scaled by the scripts' default first scale (dynamic,
    2**16), stay 16x below fp16's max. What can overflow at a batch of 2 is only the
    classifier: its gradient is (softmax - one-hot) / batch times LayerNorm outputs of
    a few units, over 1 for a batch of 2 (not for a real batch), and the scaler's
    first back-off absorbs it."""
    assert TrainConfig("imagenet").loss_scale == "dynamic"
    torch.manual_seed(0)
    model = mpfp16.to_half(models.build_imagenet_model("vit_b_16", 10, image_size=32))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), fused=False)
    default_scale = opt.loss_scale
    assert default_scale == 2.0**16
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    attention_max = []
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        assert torch.isfinite(loss)
        opt.backward(loss)
        scale = opt.loss_scale
        for name, p in model.named_parameters():
            if not name.startswith("heads."):
                assert torch.isfinite(p.grad).all(), name
        attention_max.append(max(p.grad.float().abs().max().item() / scale for name, p in model.named_parameters()
                                 if ".self_attention." in name))
        opt.step()
    assert opt.skipped_steps <= 1
    # Nothing back-propagates past the classifier until a step has moved it from zero.
    assert attention_max[0] == 0 and attention_max[-1] > 0
    assert max(attention_max) * default_scale < FP16_MAX / 16, attention_max


@pytest.mark.parametrize("argv,message", [
    (["--image-size", "40"], "vit_b_16 cannot take 40x40 images: the size must be a multiple of its patch size, 16"),
    (["--image-size", "32", "--resize-phases", "0:32,1:64"],
     "vit_b_16 is built for one image size and cannot be resized between epochs (the run asks for 32, 64): "
     "give --resize-phases one size, or drop it"),
    # A phase from epoch 0 replaces --image-size (224 by default): 224 is never used.
    (["--resize-phases", "0:32,2:48"],
     "vit_b_16 is built for one image size and cannot be resized between epochs (the run asks for 32, 48): "
     "give --resize-phases one size, or drop it"),
], ids=["not-a-patch-multiple", "resized", "resized-from-epoch-0"])
def test_sizes_a_vit_cannot_take_are_refused_in_one_line(tmp_path, capsys, argv, message):
    status, err = run_main(train_imagenet.main, ["-a", "vit_b_16", *argv, "--checkpoint-dir", str(tmp_path)], capsys)
    assert status == 2 and err == f"error: {message}\n"
    assert os.listdir(tmp_path) in ([], [".mpfp16.lock"])


def test_archs_built_for_one_size_get_the_run_size():
    with torch.device("meta"):
        vit = models.build_imagenet_model("vit_b_32", 10, image_size=64)
        maxvit = models.build_imagenet_model("maxvit_t", 10, image_size=448)
        resnet = models.build_imagenet_model("resnet18", 10, image_size=64)
    assert vit.image_size == 64 and vit.encoder.pos_embedding.shape == (1, 2 * 2 + 1, 768)
    assert maxvit.blocks[-1].grid_size == (14, 14)  # 448 / 32; 224 would give 7
    assert resnet.fc.out_features == 10
    assert [models.has_fixed_input_size("imagenet", a) for a in ("vit_b_16", "maxvit_t", "swin_t", "resnet50")] \
        == [True, True, False, False]
    models.check_image_sizes("imagenet", "swin_t", [32, 64])  # a Swin pads its windows: any size, resizable
    with pytest.raises(models.ImageSizeError, match=r"maxvit_t cannot take 64x64 images: .*partition size"):
        models.check_image_sizes("imagenet", "maxvit_t", [64])

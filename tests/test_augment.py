"""torchvision's reference recipe (mpfp16/train/augment.py, sampler.py, data.py): every
transform against torchvision's own, built here as references/classification/presets.py
builds it, for the same RNG state; mixup and cutmix against torchvision.transforms.v2's
MixUp/CutMix, and against their math; repeated augmentation against a reimplementation
of references/classification/sampler.py's RASampler, per rank, per epoch, and resumed
mid-epoch; and every draw a function of (seed, epoch, index), so that a resumed run
draws what the uninterrupted one drew."""

import itertools
import math

import pytest
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2

from mpfp16.train import augment as A
from mpfp16.train import data as D
from mpfp16.train import resume as R
from mpfp16.train.sampler import RepeatedAugmentationSampler

MEAN, STD = D.IMAGENET_MEAN, D.IMAGENET_STD
POLICIES = [None, "ra", "ta_wide", "augmix", "imagenet", "cifar10", "svhn"]


def images(n=4, size=40, seed=0):
    return D.synthetic_images(n, size, 10, seed=seed)[0]


def normalize_as_the_engine(x, mean=MEAN, std=STD):
    """The engine's _prepare: uint8 or float pixels -> (x - 255 mean) / (255 std)."""
    shape = (3, 1, 1) if x.ndim == 3 else (1, 3, 1, 1)
    return x.float().sub(torch.tensor(mean).view(shape) * 255).div(torch.tensor(std).view(shape) * 255)


def preset_train(crop_size, *, interpolation=InterpolationMode.BILINEAR, auto_augment_policy=None, ra_magnitude=9,
                 augmix_severity=3, random_erase_prob=0.0, mean=MEAN, std=STD):
    """ClassificationPresetTrain(backend="tensor", use_v2=True), as presets.py builds it."""
    T = v2
    transforms = [T.RandomResizedCrop(crop_size, interpolation=interpolation, antialias=True),
                  T.RandomHorizontalFlip(0.5)]
    if auto_augment_policy is not None:
        if interpolation == InterpolationMode.BICUBIC:  # the PIL backend's policy: tensors refuse bicubic rotations
            transforms.append(T.ToPILImage())
        if auto_augment_policy == "ra":
            transforms.append(T.RandAugment(interpolation=interpolation, magnitude=ra_magnitude))
        elif auto_augment_policy == "ta_wide":
            transforms.append(T.TrivialAugmentWide(interpolation=interpolation))
        elif auto_augment_policy == "augmix":
            transforms.append(T.AugMix(interpolation=interpolation, severity=augmix_severity))
        else:
            aa_policy = T.AutoAugmentPolicy(auto_augment_policy)
            transforms.append(T.AutoAugment(policy=aa_policy, interpolation=interpolation))
        if interpolation == InterpolationMode.BICUBIC:
            transforms.append(T.PILToTensor())
    transforms += [T.ToDtype(torch.float, scale=True), T.Normalize(mean=mean, std=std)]
    if random_erase_prob > 0:
        transforms.append(T.RandomErasing(p=random_erase_prob))
    transforms.append(T.ToPureTensor())
    return T.Compose(transforms)


def preset_eval(crop_size, resize_size=256, *, interpolation=InterpolationMode.BILINEAR, mean=MEAN, std=STD):
    """ClassificationPresetEval(backend="tensor", use_v2=True)."""
    return v2.Compose([v2.Resize(resize_size, interpolation=interpolation, antialias=True), v2.CenterCrop(crop_size),
                       v2.ToDtype(torch.float, scale=True), v2.Normalize(mean=mean, std=std), v2.ToPureTensor()])


def run_seeded(transform, seed, x):
    torch.manual_seed(seed)
    return transform(x)


def assert_same_normalized(ours, ref):
    """Ours (pixels, normalized as the engine does) is torchvision's (scaled, then
    Normalize) to float rounding, and the erased pixels (torchvision's exact zeros) are
    exactly 0 in ours too."""
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    assert (ours[ref == 0] == 0).all()


# ----------------------------------------------------------------- the per-sample transforms


def test_without_the_recipe_the_pipelines_are_the_ones_before_it():
    """No setting given: the transforms, the seeds and the data sets of before."""
    x = images(1, 64)[0]
    old_train = v2.Compose([v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip()])
    old_val = v2.Compose([v2.Resize(round(32 * 256 / 224), antialias=True), v2.CenterCrop(32)])
    old_cifar = v2.Compose([v2.RandomCrop(32, padding=4, padding_mode="reflect"), v2.RandomHorizontalFlip()])
    for ours, old in ((D.imagenet_transforms(32)[0], old_train), (D.imagenet_transforms(32)[1], old_val),
                      (A.cifar_train_transform(32), old_cifar), (A.imagenet_train_transform(32, A.Augmentation()),
                                                                 old_train)):
        for seed in range(5):
            out = run_seeded(ours, seed, x)
            assert out.dtype == torch.uint8 and torch.equal(out, run_seeded(old, seed, x))
    assert A.cifar_val_transform() is None and A.cifar_val_transform(A.Augmentation()) is None
    assert D.sample_seed(3, 1, 7) == hash((3, 1, 7)) & 0x7FFF_FFFF_FFFF_FFFF
    spec = D.cifar_data(None, 0, (8, 4))
    assert spec.val.transform is None and spec.make_transforms is None
    assert torch.equal(spec.train[(1, 5)][0], D.augment.seeded(old_cifar, D.sample_seed(0, 1, 5), spec.train.images[5]))


@pytest.mark.parametrize("policy,interpolation", [
    (p, i) for p, i in itertools.product(POLICIES, ["bilinear", "nearest", "bicubic"])
    if (p, i) != ("augmix", "bicubic")])  # refused: torchvision's AugMix cannot rotate with bicubic
def test_the_training_transform_is_classification_preset_train(policy, interpolation):
    """RandomResizedCrop, flip, the policy, Normalize, RandomErasing: torchvision's preset
    for the same RNG state, the erasing included (to the mean pixel here, which the
    engine's normalization makes exactly torchvision's 0)."""
    mode = InterpolationMode(interpolation)
    x = images(1, 48)[0]
    for erase in (0.0, 1.0):
        aug = A.Augmentation(auto_augment=policy, ra_magnitude=7, augmix_severity=4, random_erase=erase,
                             interpolation=interpolation)
        ours_tf = A.imagenet_train_transform(24, aug, MEAN)
        ref_tf = preset_train(24, interpolation=mode, auto_augment_policy=policy, ra_magnitude=7, augmix_severity=4,
                              random_erase_prob=erase)
        for seed in range(4):
            ours = run_seeded(ours_tf, seed, x)
            assert ours.dtype == (torch.float32 if erase else torch.uint8)
            ref = run_seeded(ref_tf, seed, x)
            assert_same_normalized(normalize_as_the_engine(ours), ref)
            if erase:
                assert (ref == 0).sum() > 0  # p=1: a box was erased


def test_the_policies_are_torchvisions_classes_with_their_settings():
    def policy(name, **kw):
        return A.auto_augment(name, **kw)

    ra = policy("ra", interpolation="nearest", ra_magnitude=5)
    assert type(ra) is v2.RandAugment and ra.magnitude == 5 and ra.interpolation == InterpolationMode.NEAREST
    assert type(policy("ta_wide")) is v2.TrivialAugmentWide
    mix = policy("augmix", augmix_severity=2)
    assert type(mix) is v2.AugMix and mix.severity == 2 and mix.interpolation == InterpolationMode.BILINEAR
    aa = policy("imagenet", interpolation="nearest")
    assert type(aa) is v2.AutoAugment and aa.policy == v2.AutoAugmentPolicy.IMAGENET
    assert policy("cifar10").policy == v2.AutoAugmentPolicy.CIFAR10
    bicubic = policy("ta_wide", interpolation="bicubic")  # on a PIL image: tensors refuse bicubic rotations
    assert [type(t) for t in bicubic.transforms] == [v2.ToPILImage, v2.TrivialAugmentWide, v2.PILToTensor]
    x = images(1, 32)[0]
    for seed in range(6):
        out = run_seeded(bicubic, seed, x)
        assert out.dtype == torch.uint8 and out.shape == x.shape
    from mpfp16.train.config import ConfigError

    with pytest.raises(ConfigError, match="unknown --auto-augment 'rand'; choose one of ra, ta_wide, augmix, imagenet"):
        policy("rand")
    with pytest.raises(ConfigError, match="unknown --interpolation 'lanczos'"):
        A.interpolation_mode("lanczos")
    with pytest.raises(ConfigError, match="--auto-augment augmix cannot go with --interpolation bicubic"):
        policy("augmix", interpolation="bicubic")
    with pytest.raises(ValueError, match="bicubic"):  # torchvision's own, on a tensor and on a PIL image
        for seed in range(10):
            run_seeded(v2.Compose([v2.ToPILImage(), v2.AugMix(interpolation=InterpolationMode.BICUBIC)]), seed, x)


@pytest.mark.parametrize("resize,crop,expected", [(None, None, (37, 32)), (None, 48, (55, 48)), (40, None, (40, 32)),
                                                  (36, 28, (36, 28))])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_validation_is_classification_preset_eval(resize, crop, expected, interpolation):
    """Resize(val_resize_size, interpolation), CenterCrop(val_crop_size); None: the crop
    is the image size, the resize the crop * 256/224 (the rule before the recipe)."""
    aug = A.Augmentation(val_resize_size=resize, val_crop_size=crop, interpolation=interpolation)
    assert A.val_sizes(32, aug) == expected
    assert A.val_sizes(224) == (256, 224)
    x = images(1, 64)[0]
    ours = D.imagenet_transforms(32, aug)[1](x)
    ref = preset_eval(expected[1], expected[0], interpolation=InterpolationMode(interpolation))(x)
    assert ours.dtype == torch.uint8
    assert_same_normalized(normalize_as_the_engine(ours), ref)


@pytest.mark.parametrize("policy", [None, "ra", "ta_wide", "augmix", "imagenet"])
def test_cifar_is_its_crop_and_flip_then_the_policy_and_the_erasing(policy):
    """CIFAR: today's crop and flip, then the preset's policy, Normalize, RandomErasing
    ("imagenet" is the ImageNet policy here too: the names are torchvision's)."""
    mean, std = D.CIFAR_MEAN, D.CIFAR_STD
    x = images(1, 32)[0]
    aug = A.Augmentation(auto_augment=policy, random_erase=0.5)
    ours_tf = A.cifar_train_transform(32, aug, mean)
    ref_tf = v2.Compose([v2.RandomCrop(32, padding=4, padding_mode="reflect"), v2.RandomHorizontalFlip()]
                        + ([A.auto_augment(policy)] if policy else [])
                        + [v2.ToDtype(torch.float, scale=True), v2.Normalize(mean, std), v2.RandomErasing(p=0.5)])
    erased = 0
    for seed in range(8):
        ref = run_seeded(ref_tf, seed, x)
        assert_same_normalized(normalize_as_the_engine(run_seeded(ours_tf, seed, x), mean, std), ref)
        erased += bool((ref == 0).any())
    assert erased > 0
    # validation: the images as they are, unless a resize or crop is asked for
    val = A.cifar_val_transform(A.Augmentation(val_resize_size=36, val_crop_size=30))
    assert torch.equal(val(x), v2.CenterCrop(30)(v2.Resize(36, antialias=True)(x)))
    assert A.cifar_val_transform(A.Augmentation(val_crop_size=28))(x).shape == (3, 28, 28)


def test_erased_pixels_normalize_to_exactly_zero_on_the_engines_mean():
    """The erasing value is build.data's ``Data.mean`` (``tensor(mean) * 255``, float32),
    so ``x - mean`` is exactly 0 there, for the synthetic sets' mean and ImageNet's."""
    for mean in ((0.5, 0.5, 0.5), D.IMAGENET_MEAN, D.CIFAR_MEAN):
        erase = v2.Compose(A.erasing(1.0, mean))
        out = run_seeded(erase, 0, images(1, 32)[0])
        engine_mean = torch.tensor(mean).view(1, 3, 1, 1) * 255
        assert ((out[None] - engine_mean) == 0).all(dim=1).sum() > 0


def test_the_data_sets_build_the_recipe_from_the_config():
    from mpfp16.train.config import TrainConfig

    cfg = TrainConfig(task="imagenet", auto_augment="ta_wide", random_erase=0.25, interpolation="nearest",
                      val_resize_size=40, val_crop_size=36, ra_magnitude=3, augmix_severity=2)
    aug = A.Augmentation.from_config(cfg)
    assert aug == A.Augmentation("ta_wide", 3, 2, 0.25, "nearest", 40, 36)
    assert A.Augmentation.from_config(TrainConfig(task="cifar")) == A.Augmentation()
    spec = D.imagenet_data(None, 32, 0, "fail", (6, 3), augmentation=aug)
    names = [type(t).__name__ for t in spec.train.transform.transforms]
    assert names == ["RandomResizedCrop", "RandomHorizontalFlip", "TrivialAugmentWide", "ToDtype", "RandomErasing"]
    assert spec.train.transform.transforms[0].interpolation == InterpolationMode.NEAREST
    assert spec.train.transform.transforms[-1].value == (torch.tensor(spec.mean) * 255).tolist()
    assert spec.val[(0, 1)][0].shape == (3, 36, 36)
    # a resize phase: the same recipe at another crop (the val crop stays val_crop_size)
    train, val = spec.make_transforms(48)
    assert train.transforms[0].size == (48, 48) and type(train.transforms[2]) is v2.TrivialAugmentWide
    assert val.transforms[0].size == [40] and val.transforms[1].size == (36, 36)
    plain = D.imagenet_data(None, 32, 0, "fail", (6, 3))
    assert [type(t).__name__ for t in plain.make_transforms(48)[0].transforms] == ["RandomResizedCrop",
                                                                                   "RandomHorizontalFlip"]
    cifar = D.cifar_data(None, 0, (6, 3), augmentation=A.Augmentation(auto_augment="ra", random_erase=0.5))
    assert [type(t).__name__ for t in cifar.train.transform.transforms][2:] == ["RandAugment", "ToDtype",
                                                                                "RandomErasing"]
    assert cifar.train[(0, 2)][0].dtype == torch.float32


def test_a_sample_is_a_function_of_seed_epoch_index_and_position():
    """The same key gives the same image from a fresh data set, whatever drew from the
    global RNG before; another epoch, index or position another one; the global RNG
    (CPU, and any CUDA one: never reseeded) is left as it was."""
    aug = A.Augmentation(auto_augment="augmix", random_erase=0.5)
    xs, ys = D.synthetic_images(6, 32, 10, seed=1)

    def dataset():
        return D.InMemoryImages(xs, ys, A.cifar_train_transform(32, aug), seed=11)

    first = dataset()
    keys = [(0, 2), (1, 2), (0, 3), (0, 2, 6), (0, 2, 7), (1, 2, 6)]
    out = [first[k][0] for k in keys]
    for i, j in itertools.combinations(range(len(keys)), 2):
        assert not torch.equal(out[i], out[j]), (keys[i], keys[j])
    torch.manual_seed(123)
    torch.rand(5)
    state = torch.get_rng_state()
    again = dataset()
    assert all(torch.equal(again[k][0], o) for k, o in zip(keys, out))
    assert torch.equal(torch.get_rng_state(), state)


def test_an_image_folder_takes_repeated_augmentations_keys(tmp_path):
    from fake_data import write_fake_imagefolder

    root = write_fake_imagefolder(tmp_path)
    aug = A.Augmentation(auto_augment="ra")
    spec = D.imagenet_data(root, 24, 0, "fail", (0, 0), augmentation=aug)
    assert spec.mean == D.IMAGENET_MEAN
    a, b, c = spec.train[(0, 1, 3)][0], spec.train[(0, 1, 4)][0], spec.train[(0, 1, 3)][0]
    assert torch.equal(a, c) and not torch.equal(a, b) and a.shape == (3, 24, 24)


# ----------------------------------------------------------------- mixup and cutmix


MIXES = [(0.2, 0.0), (0.0, 1.0), (0.8, 1.0)]


def batch(n=6, size=16, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("mixup,cutmix", MIXES)
def test_mix_batch_is_torchvisions_mixup_cutmix_for_the_same_rng_state(mixup, cutmix):
    """torchvision's train.py: RandomChoice([MixUp, CutMix]) of those with alpha > 0 on
    the collated batch; here under the seed of (seed, epoch, index)."""
    x, y = batch()
    for epoch, index in ((0, 0), (0, 12), (3, 12)):
        ours = A.mix_batch(x, y, epoch=epoch, index=index, seed=5, mixup_alpha=mixup, cutmix_alpha=cutmix,
                           num_classes=5)
        choices = ([v2.MixUp(alpha=mixup, num_classes=5)] if mixup else []) + \
                  ([v2.CutMix(alpha=cutmix, num_classes=5)] if cutmix else [])
        torch.manual_seed(A.mix_seed(5, epoch, index))
        ref = v2.RandomChoice(choices)(x, y)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
        assert ours[1].dtype == torch.float32 and ours[1].shape == (6, 5)
        assert torch.allclose(ours[1].sum(1), torch.ones(6))


def test_mixup_and_cutmix_are_their_math():
    """Given the draws (the choice, lambda, the box) made from the seeded generator as
    torchvision makes them: mixup is lam x + (1 - lam) x.roll(1), cutmix pastes the
    rolled batch's box, and the targets mix the one-hot labels by lam, or by the box's
    share of the image."""
    x, y = batch(n=5, size=20)
    onehot = torch.nn.functional.one_hot(y, 5).float()
    kinds = set()
    for index in range(40):
        out, target = A.mix_batch(x, y, epoch=1, index=index, seed=0, mixup_alpha=0.4, cutmix_alpha=1.0,
                                  num_classes=5)
        gen = torch.Generator().manual_seed(A.mix_seed(0, 1, index))
        choice = int(torch.multinomial(torch.tensor([0.5, 0.5]), 1, generator=gen))
        alpha = (0.4, 1.0)[choice]
        lam = float(torch._sample_dirichlet(torch.tensor([[alpha, alpha]]), generator=gen)[0, 0])
        if choice == 0:
            kinds.add("mixup")
            assert torch.allclose(out, lam * x + (1 - lam) * x.roll(1, 0), atol=1e-6)
        else:
            kinds.add("cutmix")
            r_x, r_y = int(torch.randint(20, (1,), generator=gen)), int(torch.randint(20, (1,), generator=gen))
            half = int(0.5 * math.sqrt(1 - lam) * 20)
            x1, y1, x2, y2 = max(r_x - half, 0), max(r_y - half, 0), min(r_x + half, 20), min(r_y + half, 20)
            expected = x.clone()
            expected[..., y1:y2, x1:x2] = x.roll(1, 0)[..., y1:y2, x1:x2]
            assert torch.equal(out, expected)
            lam = 1 - (x2 - x1) * (y2 - y1) / 400
        assert torch.allclose(target, lam * onehot + (1 - lam) * onehot.roll(1, 0), atol=1e-6)
    assert kinds == {"mixup", "cutmix"}


def test_mix_batch_is_a_function_of_seed_epoch_and_index_only():
    x, y = batch()
    kw = dict(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=5)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = A.mix_batch(x, y, epoch=2, index=30, seed=1, **kw)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was
    torch.rand(7)
    b = A.mix_batch(x.clone(), y, epoch=2, index=30, seed=1, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for other in (dict(epoch=3, index=30, seed=1), dict(epoch=2, index=31, seed=1), dict(epoch=2, index=30, seed=2)):
        assert not torch.equal(A.mix_batch(x, y, **other, **kw)[1], a[1])
    assert torch.equal(x, batch()[0])  # the input is not changed
    same = A.mix_batch(x, y, epoch=0, index=0, seed=0, mixup_alpha=0.0, cutmix_alpha=0.0, num_classes=5)
    assert same[0] is x and same[1] is y
    last = A.mix_batch(x.contiguous(memory_format=torch.channels_last), y, epoch=2, index=30, seed=1, **kw)
    assert last[0].is_contiguous(memory_format=torch.channels_last) and torch.equal(last[0], a[0])
    # soft targets train through the engine's loss as they are (label smoothing too)
    loss = torch.nn.functional.cross_entropy(torch.randn(6, 5), a[1], label_smoothing=0.1)
    assert torch.isfinite(loss)


def test_the_batch_index_is_the_position_of_the_batchs_first_sample():
    """batch_index(...) is the position its first sample has in the epoch's order, as the
    samplers deal it: unique over ranks and micro-batches, and the same from any resume
    of the same shape."""
    world, batch_size, accum = 3, 4, 2
    seen = set()
    for rank in range(world):
        sampler = RepeatedAugmentationSampler(range(800), world, rank, seed=0, repetitions=2)
        sampler.set_epoch(1, 48)
        micro = list(D.StepBatches(sampler, [batch_size] * 6))
        for step in range(3):
            samples_done = 48 + step * world * batch_size * accum
            for m in range(accum):
                first_key = micro[step * accum + m][0]
                index = A.batch_index(samples_done, earlier=m * batch_size, world_size=world, rank=rank)
                assert first_key[2] == index and index not in seen
                seen.add(index)


# ----------------------------------------------------------------- repeated augmentation


def reference_ra_sampler(size, world, rank, epoch, seed=0, reps=3, shuffle=True):
    """torchvision's RASampler.__iter__ (references/classification/sampler.py)."""
    num_samples = int(math.ceil(size * float(reps) / world))
    total_size = num_samples * world
    num_selected_samples = int(math.floor(size // 256 * 256 / world))
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(size, generator=g).tolist()
    else:
        indices = list(range(size))
    indices = torch.tensor(indices).repeat_interleave(reps).tolist()
    indices += indices[: (total_size - len(indices))]
    assert len(indices) == total_size
    indices = indices[rank:total_size:world]
    assert len(indices) == num_samples
    return indices[:num_selected_samples]


@pytest.mark.parametrize("size", [256, 300, 1000, 2000])
def test_the_ra_sampler_is_torchvisions_per_rank_and_epoch(size):
    for world, reps, epoch, seed in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4), (0, 1, 2), (0, 7)):
        ranks = []
        for rank in range(world):
            sampler = RepeatedAugmentationSampler(range(size), world, rank, seed=seed, repetitions=reps)
            sampler.set_epoch(epoch)
            keys = list(sampler)
            expected = reference_ra_sampler(size, world, rank, epoch, seed, reps)
            assert [k[1] for k in keys] == expected and len(sampler) == len(expected)
            assert all(k[0] == epoch for k in keys)
            assert [k[2] for k in keys] == list(range(rank, sampler.epoch_size, world))
            ranks.append(keys)
        # spread across ranks: the order's positions, each once
        assert sorted(k[2] for keys in ranks for k in keys) == list(range(size // 256 * 256 // world * world))
    unshuffled = RepeatedAugmentationSampler(range(300), 2, 1, shuffle=False, repetitions=3)
    assert [k[1] for k in unshuffled] == reference_ra_sampler(300, 2, 1, 0, shuffle=False)
    assert len(RepeatedAugmentationSampler(range(255), 1, 0)) == 0  # torchvision's floor: fewer than 256, none


def test_the_ra_sampler_resumes_from_any_position():
    """set_epoch(epoch, samples_done) continues the epoch's one order: the same shape
    gets exactly the uninterrupted run's keys; another shape the rest, each position
    once (epoch_rest, with the sampler's epoch_size)."""
    size, seed = 700, 3
    for world, batch_size, accum in ((1, 8, 1), (2, 8, 2), (4, 5, 1), (3, 4, 2)):
        def shares(world, batch_size, accum, start):
            epoch_size = RepeatedAugmentationSampler(range(size), world, 0, seed=seed).epoch_size
            rest = R.epoch_rest(start, dataset_size=epoch_size, world_size=world, batch_size=batch_size,
                                accum_steps=accum)
            sizes = [batch_size] * (rest.full_steps * accum) + list(rest.last_step)
            out = []
            for rank in range(world):
                sampler = D.train_sampler(range(size), world, rank, seed=seed, ra_sampler=True, ra_reps=3)
                sampler.set_epoch(2, start)
                out.append([k for micro in D.StepBatches(sampler, sizes) for k in micro])
            return out, rest

        whole, rest = shares(world, batch_size, accum, 0)
        assert not rest.last_step
        per_step = world * batch_size * accum
        for steps in (1, rest.full_steps // 2):
            done = steps * per_step
            resumed, _ = shares(world, batch_size, accum, done)
            for rank in range(world):
                assert whole[rank][steps * batch_size * accum:] == resumed[rank]
            for other in ((1, 7, 1), (2, 3, 3)):  # another shape: the rest of the order, none twice
                after, _ = shares(*other, done)
                positions = [k[2] for keys in after for k in keys]
                assert len(set(positions)) == len(positions) and min(positions) >= done
                order = RepeatedAugmentationSampler(range(size), other[0], 0, seed=seed)
                order.set_epoch(2)
                indices = order.order()
                assert all(indices[k[2]] == k[1] for keys in after for k in keys)


def test_the_repeats_of_an_image_are_augmented_differently():
    """The repeats of an index (the same image, reps times in a row in the order) get
    different crops: the key carries the position. Through the loader as the engine
    builds it, the same images as the data set gives for the keys."""
    xs, ys = D.synthetic_images(256, 32, 10, seed=1)
    dataset = D.InMemoryImages(xs, ys, A.cifar_train_transform(32, A.Augmentation(auto_augment="ta_wide")), seed=0)
    sampler = D.train_sampler(dataset, 2, 1, seed=0, ra_sampler=True, ra_reps=3)
    sampler.set_epoch(0)
    keys = list(sampler)
    by_index = {}
    for key in keys:
        by_index.setdefault(key[1], []).append(key)
    repeated = [ks for ks in by_index.values() if len(ks) > 1]
    assert repeated  # with 2 ranks and 3 repeats, a rank gets an image more than once
    for ks in repeated:
        crops = [dataset[k][0] for k in ks]
        assert all(not torch.equal(a, b) for a, b in itertools.combinations(crops, 2))
    loader = D.make_loader(dataset, sampler, 8, 0, False, drop_last=True, batch_sizes=[8, 8])
    got = [b[0] for b in loader]
    assert torch.equal(torch.cat(got), torch.stack([dataset[k][0] for k in keys[:16]]))


def test_the_plain_sampler_is_unchanged_and_tells_its_epoch_size():
    sampler = D.train_sampler(range(50), 2, 1, seed=4)
    assert type(sampler) is D.ResumableDistributedSampler and sampler.epoch_size == 50
    sampler.set_epoch(1, 6)
    assert [k for k in sampler] == [(1, i) for i in sampler.order()[7::2][:22]]
    ra = D.train_sampler(range(600), 4, 0, seed=4, ra_sampler=True, ra_reps=2)
    assert type(ra) is RepeatedAugmentationSampler and ra.repetitions == 2 and ra.epoch_size == 512
    with pytest.raises(ValueError, match="rank 4 is not one of 4"):
        RepeatedAugmentationSampler(range(600), 4, 4)


@pytest.mark.cuda
def test_on_the_gpu_the_mix_and_the_erasing_are_the_cpus():
    """Images on the GPU: the draws stay on the CPU generator (the same mix as on the
    CPU, the CUDA generator left alone), and the erased pixels normalize to exactly 0
    against the mean as build.data puts it on the device."""
    x, y = batch(n=8, size=24)
    kw = dict(epoch=1, index=9, seed=3, mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=5)
    cuda_state = torch.cuda.get_rng_state()
    for index in range(6):
        kw["index"] = index
        cpu = A.mix_batch(x, y, **kw)
        gpu = A.mix_batch(x.cuda(), y.cuda(), **kw)
        assert torch.allclose(gpu[0].cpu(), cpu[0], atol=1e-6) and torch.allclose(gpu[1].cpu(), cpu[1], atol=1e-6)
    sample = D.InMemoryImages(images(2, 32), torch.zeros(2, dtype=torch.long),
                              A.cifar_train_transform(32, A.Augmentation(random_erase=1.0), MEAN))[(0, 1)][0]
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255
    normalized = sample[None].cuda().float().sub_(mean).div_(std)
    assert (normalized == 0).all(dim=1).sum() > 0

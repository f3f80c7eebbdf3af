"""Training recipes as code: each is a function returning a :class:`~vitkit.configs.schema.TrainConfig`.

| recipe | what |
|---|---|
| ``digits`` | the default job: a small ViT on the bundled 8x8 digits (>= 98.6% test top-1 on 2 CPU cores) |
| ``cifar-small`` | a small ViT on CIFAR-10 from scratch, sized for a CPU or one GPU |
| ``paper-pretrain`` | paper Table 3: Adam, batch 4096, 10k warmup, linear decay, clip 1; ImageNet-21k or JFT |
| ``paper-imagenet`` | paper Table 3, last row: ViT from scratch on ImageNet-1k, 300 epochs, lr 3e-3, cosine, wd 0.3 |
| ``paper-finetune`` | paper Table 4: SGD momentum 0.9, batch 512, cosine, no weight decay, clip 1, 384 px |
| ``finetune-small`` | the paper's fine-tuning recipe scaled to a CPU: batch 64, 300 steps |
| ``deit-i1k`` | DeiT (Touvron et al. 2021): AdamW, 300 epochs, RandAugment, Mixup + CutMix, label smoothing |
| ``plain-vit-s16`` | "Better plain ViT baselines" (Beyer et al. 2022): S/16, GAP, sin-cos, 90 epochs -> 76.5% |

Recipes are sized for their own data sets (batch 1024 and 10k warm-up steps for ImageNet's 1.28M images). On
other data the run is what its data makes it: the batch must fit the training set (``--batch-size``, an error
naming it otherwise), and the warm-up, in steps once the epoch length is known, takes at most a fifth of the
run's steps (``optim.warmup_max_fraction``, 0.2): a longer one is scaled down to that fifth, with a note on
stderr (``plain-vit-s16`` on 32 images, batch 16, 30 epochs: 60 steps, 12 of warm-up instead of 3,333, so the
learning rate reaches its value; ``--set optim.warmup_max_fraction=null`` keeps the warm-up as given). Every
recipe's warm-up on its own data set is within that fifth (2-11% of the run; ``paper-finetune`` caps its own at a
fifth), so there nothing changes. ``--epochs``/``--steps`` shorter than the recipe's shrink its warm-up in
proportion first (``vitkit.configs.overrides.shortened_warmup``).

Weight decay is AdamW's (p -= lr * wd * p). big_vision's ``wd`` is not multiplied by the base lr, so its
``wd=1e-4`` at ``lr=1e-3`` is ``weight_decay=0.1`` here; the paper's and AugReg's values (0.03, 0.1) are
already in this convention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vitkit.configs.schema import AugConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig
from vitkit.errors import ConfigError


def digits() -> TrainConfig:
    """The default ``vitkit train`` job: a 4-layer, 64-wide ViT (GAP, 4x4 patches) on the 8x8 digits
    upsampled to 16x16, with random-resized crops, Mixup 0.8, label smoothing 0.1 and EMA weights; AdamW,
    70 epochs of batch 128. >= 98.6% test top-1 (99.1% mean over seeds 0-3) in about 40 s on 2 CPU cores
    with AVX-512 (see BENCHMARKS.md). Mixup 0.8 (AugReg's strongest level) instead of 0.2: the model
    overfitted the 1,438 training images after ~45 epochs; the compute is unchanged."""
    return TrainConfig(
        name="digits",
        recipe="digits",
        data=DataConfig(
            source="digits", image_size=(16, 16), batch_size=128, eval_batch_size=512, workers=0, grayscale=True
        ),
        aug=AugConfig(crop="inception", crop_scale=(0.7, 1.0), flip=False, mixup=0.8, label_smoothing=0.1),
        model=ModelConfig(
            name=None,
            overrides={
                "patch_size": 4,
                "hidden_size": 64,
                "depth": 4,
                "num_heads": 4,
                "mlp_dim": 128,
                "classifier": "gap",
            },
        ),
        optim=OptimConfig(name="adamw", lr=3e-3, weight_decay=0.05, warmup_epochs=2, schedule="cosine", clip_norm=1.0),
        epochs=70,
        ema_decay=0.995,
        ema_warmup=True,
        log_every_steps=20,
    )


def cifar_small() -> TrainConfig:
    """A 6-layer, 192-wide ViT with 4x4 patches on 32x32 CIFAR-10 (AdamW, RandAugment, label smoothing)."""
    return TrainConfig(
        name="cifar-small",
        recipe="cifar-small",
        data=DataConfig(source="cifar-10-batches-py", image_size=(32, 32), batch_size=128, workers=2),
        aug=AugConfig(crop="pad", pad=4, flip=True, randaug_layers=2, randaug_magnitude=9, label_smoothing=0.1),
        model=ModelConfig(
            name=None,
            overrides={
                "patch_size": 4,
                "hidden_size": 192,
                "depth": 6,
                "num_heads": 3,
                "mlp_dim": 384,
                "drop_path": 0.1,
            },
        ),
        optim=OptimConfig(name="adamw", lr=1e-3, weight_decay=0.05, warmup_epochs=5, schedule="cosine", clip_norm=1.0),
        epochs=100,
        ema_decay=0.999,
        ema_warmup=True,
    )


# Paper Table 3 (pre-training): base learning rates by model and data set.
_JFT_LR = {"B/16": 8e-4, "B/32": 8e-4, "L/32": 6e-4, "L/16": 4e-4, "H/14": 3e-4}
_JFT_EPOCHS = {"H/14": 14}


def paper_pretrain(variant: str = "B/16", dataset: str = "imagenet21k", source: str = "imagenet21k") -> TrainConfig:
    """Paper sec. 4.1 / Table 3: Adam (0.9, 0.999), batch 4096, 10k warmup then linear decay, clip 1,
    224 px, inception crop + flip, pre-logits layer of width D, sigmoid loss with head bias -10 (the
    official multi-label pre-training heads). ImageNet-21k: 90 epochs, lr 1e-3, wd 0.03, dropout 0.1.
    JFT-300M: 7 epochs (14 for H/14), lr by model (8e-4 B, 6e-4 L/32, 4e-4 L/16, 3e-4 H/14), wd 0.1."""
    from vitkit.models.variants import VARIANTS, parse_name  # here: the recipe table imports no torch

    size, patch = parse_name(variant)
    name = f"{size}/{patch}"
    if dataset == "imagenet21k":
        lr, wd, dropout, epochs = 1e-3, 0.03, 0.1, 90.0
    elif dataset == "jft300m":
        lr, wd, dropout, epochs = _JFT_LR.get(name, 8e-4), 0.1, 0.0, float(_JFT_EPOCHS.get(name, 7))
    else:
        raise ConfigError(f"paper-pretrain: dataset must be imagenet21k or jft300m, got {dataset!r}")
    return TrainConfig(
        name=f"paper-pretrain-{size}{patch}-{dataset}",
        recipe="paper-pretrain",
        data=DataConfig(source=source, image_size=(224, 224), batch_size=4096, workers=8),
        aug=AugConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),
        model=ModelConfig(
            name=name,
            overrides={
                "dropout": dropout,
                "representation_size": VARIANTS[size]["hidden_size"],
                "head_bias_init": -10.0,
            },
        ),
        optim=OptimConfig(name="adam", lr=lr, weight_decay=wd, warmup_steps=10_000, schedule="linear", clip_norm=1.0),
        loss="sigmoid",
        epochs=epochs,
        precision="bf16",
        checkpoint_every_steps=1000,
    )


def paper_imagenet(variant: str = "B/16", source: str = "imagenet") -> TrainConfig:
    """Paper Table 3, "ViT-* on ImageNet": 300 epochs, Adam, lr 3e-3, cosine, wd 0.3, dropout 0.1,
    batch 4096, 10k warmup, clip 1."""
    cfg = paper_pretrain(variant, "imagenet21k", source)
    cfg.name, cfg.recipe = f"paper-imagenet-{variant.replace('/', '')}", "paper-imagenet"
    cfg.model.overrides = {"dropout": 0.1, "representation_size": cfg.model.overrides["representation_size"]}
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.schedule = 3e-3, 0.3, "cosine"
    cfg.loss, cfg.epochs = "softmax", 300.0
    return cfg


#: Paper Table 4 (fine-tuning): steps per data set; lr swept over {0.001, 0.003, 0.01, 0.03} (0.01 for VTAB).
FINETUNE_STEPS = {"imagenet": 20_000, "cifar10": 10_000, "cifar100": 10_000, "pets": 500, "flowers": 500, "vtab": 2_500}


def paper_finetune(
    init_from: str | None = None,
    source: str = "",
    task: str | None = None,
    steps: int = 500,
    lr: float = 0.01,
    image_size: int = 384,
) -> TrainConfig:
    """Paper Table 4 / vit_jax fine-tuning: SGD momentum 0.9, batch 512, cosine decay, no weight decay,
    global-norm clip 1, inception crop + flip, 384 px. Steps by ``task`` (ImageNet 20k, CIFAR 10k, Pets
    and Flowers 500, VTAB 2.5k), else ``steps``. Warmup: vit_jax's 500 steps, capped at a fifth of the run.
    ``vitkit finetune --recipe paper-finetune``; without a recipe, ``finetune`` sizes its schedule by the data
    (:func:`finetune_for_data`)."""
    if task is not None:
        if task not in FINETUNE_STEPS:
            raise ConfigError(f"paper-finetune: task must be one of {', '.join(FINETUNE_STEPS)}, got {task!r}")
        steps = FINETUNE_STEPS[task]
    return TrainConfig(
        name=f"finetune-{task}" if task else "finetune",
        recipe="paper-finetune",
        data=DataConfig(source=source, image_size=(image_size, image_size), batch_size=512, workers=8),
        aug=AugConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),
        model=ModelConfig(name=None, init_from=init_from),
        optim=OptimConfig(
            name="sgd", lr=lr, momentum=0.9, weight_decay=0.0, warmup_steps=min(500, steps // 5), schedule="cosine"
        ),
        epochs=None,
        steps=steps,
        checkpoint_every_steps=500,
    )


def finetune_small(init_from: str | None = None, source: str = "") -> TrainConfig:
    """The paper's fine-tuning recipe scaled for a CPU: batch 64, 300 steps (60 warmup), lr 0.01, 224 px."""
    cfg = paper_finetune(init_from, source, steps=300, lr=0.01, image_size=224)
    cfg.name, cfg.recipe = "finetune-small", "finetune-small"
    cfg.data.batch_size, cfg.data.workers = 64, 2
    cfg.checkpoint_every_steps = 100
    return cfg


#: ``vitkit finetune``'s default schedule: the paper's Table 4 steps from this many training images (CIFAR's 50k:
#: 10k steps; ImageNet-sized, 1M: 20k steps); below it, epochs sized to the data (:func:`finetune_for_data`).
PAPER_STEPS_FROM = 50_000
SMALL_DATA_STEPS = 300  # the length aimed at below PAPER_STEPS_FROM, in steps (finetune-small's, measured)
SMALL_DATA_EPOCHS = (5, 100)  # ... within these many epochs
SMALL_DATA_BATCH = (8, 64)  # batch: a power of two near an eighth of the data set, within these bounds
WARMUP_FRACTION = 0.1  # of the run, for the epoch schedule
SMALL_DATA_LR = {"full": 0.03, "lp-ft": 0.03, "lora": 0.1}  # SGD; measured on the digits transfer (BENCHMARKS.md)


def finetune_for_data(
    train_images: int,
    image_size: tuple[int, int],
    init_from: str | None = None,
    source: str = "",
    method: str = "full",
) -> tuple[TrainConfig, str]:
    """``vitkit finetune``'s default when no recipe is named: a schedule sized by the number of images trained on,
    with why. From :data:`PAPER_STEPS_FROM` images the paper's Table 4 recipe with its steps for a data set of that
    size (batch 512, 500 warm-up steps); below it the paper's optimiser (SGD momentum 0.9, cosine, clip 1) over
    epochs, as timm's and the HF Trainer's fine-tuning scripts count them: a batch of a power of two near an
    eighth of the data (8 to 64, never more than the data), about :data:`SMALL_DATA_STEPS` steps rounded up to
    whole epochs (5 to 100), a tenth of them warming up, at the top of the paper's learning-rate sweep (0.03; 0.1
    for LoRA, whose zero-initialised adapters move slower); a milder random crop (scale 0.7-1) than the paper's
    0.05-1 and no flip (mirrored digits or text are other classes; ``--set aug.flip=true`` where they are not).
    On the digits transfer (seed 0, test top-1) the flip cost full and lp-ft 7-10 points, a crop scale of 0.35-1
    instead of 0.7-1 3-6, lr 0.01 instead of 0.03 2-3 (LoRA: 0.01 instead of 0.1, 7).
    ``image_size`` is the checkpoint's own unless asked."""
    n = train_images
    if n >= PAPER_STEPS_FROM:
        task = "imagenet" if n >= 1_000_000 else "cifar10"
        cfg = paper_finetune(init_from, source, task=task, image_size=image_size[0])
        why = (
            f"the paper's Table 4 steps for {n:,} training images ({'ImageNet' if task == 'imagenet' else 'CIFAR'}'s "
            f"{FINETUNE_STEPS[task]:,}; epochs sized to the data below {PAPER_STEPS_FROM:,} images)"
        )
    else:
        lo, hi = SMALL_DATA_BATCH
        batch = min(n, max(lo, min(hi, 1 << max(0, (n // 8).bit_length() - 1))))
        per_epoch = max(1, n // batch)
        e_lo, e_hi = SMALL_DATA_EPOCHS
        epochs = min(e_hi, max(e_lo, -(-SMALL_DATA_STEPS // per_epoch)))
        cfg = paper_finetune(init_from, source, image_size=image_size[0])
        cfg.data.batch_size, cfg.data.workers = batch, 2
        cfg.aug.crop_scale, cfg.aug.flip = (0.7, 1.0), False
        cfg.optim.lr = SMALL_DATA_LR.get(method, SMALL_DATA_LR["full"])
        cfg.steps, cfg.epochs = None, float(epochs)
        cfg.optim.warmup_steps, cfg.optim.warmup_epochs = 0, WARMUP_FRACTION * epochs
        cfg.checkpoint_every_steps = None
        why = (
            f"sized for {n:,} training images: about {SMALL_DATA_STEPS} steps in whole epochs, a tenth warming up "
            f"(the paper's {FINETUNE_STEPS['cifar10']:,}+ steps from {PAPER_STEPS_FROM:,} images)"
        )
    cfg.name, cfg.recipe, cfg.data.image_size = "finetune", "data-sized", image_size
    return cfg, why


def deit_i1k(variant: str = "S/16", source: str = "imagenet") -> TrainConfig:
    """DeiT: AdamW lr 5e-4 x batch/512 (1e-3 at 1024), wd 0.05, 300 epochs, 5 warmup epochs, cosine to 1e-5,
    RandAugment (2, 9), Mixup 0.8 / CutMix 1.0, label smoothing 0.1, stochastic depth 0.1, ImageNet mean/std,
    bicubic, eval resize 256 / crop 224. Not reproduced: repeated augmentation and random erasing."""
    from vitkit.checkpoints.preprocess import IMAGENET_MEAN, IMAGENET_STD  # here: no torch for the table
    from vitkit.models.variants import parse_name

    size, patch = parse_name(variant)
    return TrainConfig(
        name=f"deit-{size}{patch}",
        recipe="deit-i1k",
        data=DataConfig(
            source=source,
            image_size=(224, 224),
            batch_size=1024,
            workers=8,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            eval_resize="crop",
            eval_crop_pct=0.875,
        ),
        aug=AugConfig(
            crop="inception",
            crop_scale=(0.08, 1.0),
            flip=True,
            randaug_layers=2,
            randaug_magnitude=9,
            mixup=0.8,
            cutmix=1.0,
            label_smoothing=0.1,
            interpolation="bicubic",
        ),
        model=ModelConfig(name=f"{size}/{patch}", overrides={"drop_path": 0.1}),
        optim=OptimConfig(
            name="adamw", lr=1e-3, weight_decay=0.05, warmup_epochs=5, schedule="cosine", end_lr=1e-5, clip_norm=None
        ),
        epochs=300,
        precision="bf16",
        checkpoint_every_steps=2000,
    )


def plain_vit_s16(source: str = "imagenet") -> TrainConfig:
    """Better plain ViT baselines for ImageNet-1k (big_vision ``vit_s16_i1k``): S/16, global average pooling,
    fixed 2-D sin-cos position embedding, batch 1024, 90 epochs, Adam lr 1e-3, wd 1e-4 (big_vision) = 0.1
    here, 10k warmup, cosine, clip 1, inception crop + flip + RandAugment(2, 10), Mixup 0.2."""
    return TrainConfig(
        name="plain-vit-s16",
        recipe="plain-vit-s16",
        data=DataConfig(
            source=source, image_size=(224, 224), batch_size=1024, workers=8, eval_resize="crop", eval_crop_pct=0.875
        ),
        aug=AugConfig(
            crop="inception", crop_scale=(0.05, 1.0), flip=True, randaug_layers=2, randaug_magnitude=10, mixup=0.2
        ),
        model=ModelConfig(
            name="S/16", overrides={"classifier": "gap", "pos_embed": "sincos2d", "representation_size": 384}
        ),
        optim=OptimConfig(
            name="adamw", lr=1e-3, weight_decay=0.1, warmup_steps=10_000, schedule="cosine", clip_norm=1.0
        ),
        epochs=90,
        precision="bf16",
        checkpoint_every_steps=1000,
    )


#: The training recipes by name (``vitkit train --recipe NAME``), each a function returning a TrainConfig.
RECIPES: dict[str, Callable[..., TrainConfig]] = {
    "digits": digits,
    "cifar-small": cifar_small,
    "paper-pretrain": paper_pretrain,
    "paper-imagenet": paper_imagenet,
    "paper-finetune": paper_finetune,
    "finetune-small": finetune_small,
    "deit-i1k": deit_i1k,
    "plain-vit-s16": plain_vit_s16,
}


def get_recipe(name: str, **kwargs: Any) -> TrainConfig:
    """A recipe's config by name (``vitkit train --recipe NAME``); keyword arguments go to the function."""
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    try:
        return RECIPES[name](**kwargs)
    except TypeError as e:
        raise ConfigError(f"recipe {name}: {e}") from None
